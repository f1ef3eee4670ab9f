"""seqmoe-tiny: the stdlib corpus, the shipped checkpoint (loads, is small, beats a unigram, routes
non-uniformly) and a reproducible seeded training run on a tiny config.

Run: .venv/bin/python -m pytest tests/tiny -q
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from seqmoe.base.errors import UserError  # noqa: E402
from seqmoe.arch.tiny import MODEL_DIR  # noqa: E402
from seqmoe.arch.tiny.card import ROUTING_HEADING, ROUTING_MARKER  # noqa: E402
from seqmoe.arch.tiny.corpus import is_heldout, stdlib_corpus  # noqa: E402
from seqmoe.arch.tiny.train import encode_docs, heldout_nll, model_config, train_model, unigram_nll  # noqa: E402

CONTEXT = 128  # windows scored by the checkpoint tests (short: the tests stay fast)
shipped = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="seqmoe-tiny checkpoint not in this install")


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR)).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def heldout(tokenizer) -> np.ndarray:
    """Tokens of the first few held-out stdlib files (with the checkpoint's tokenizer)."""
    try:
        corpus = stdlib_corpus()
    except UserError as e:  # an install without its Lib/ source
        pytest.skip(str(e))
    return encode_docs(tokenizer.backend_tokenizer, [corpus.read(f) for f in corpus.heldout_files[:6]])


def test_corpus_split_is_deterministic_and_disjoint():
    corpus = stdlib_corpus()
    assert list(corpus.files) == sorted(corpus.files)
    assert corpus.heldout_files and len(corpus.heldout_files) < len(corpus.train_files)
    assert not set(corpus.heldout_files) & set(corpus.train_files)
    assert all(is_heldout(f) for f in corpus.heldout_files)
    assert not any(f.split("/")[0] in ("test", "idlelib", "encodings") for f in corpus.files)


def test_corpus_rejects_missing_folder(tmp_path):
    with pytest.raises(UserError, match="no standard library"):
        stdlib_corpus(tmp_path / "nope")
    with pytest.raises(UserError, match="no \\*.py"):
        stdlib_corpus(tmp_path)


@shipped
def test_checkpoint_loads_and_is_small(model, tokenizer):
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 10**6
    cfg = model.config
    assert cfg.model_type == "olmoe" and cfg.num_hidden_layers >= 8 and cfg.num_experts >= 32
    assert cfg.num_experts_per_tok in (4, 8)
    assert model.dtype == torch.float32
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>" and tokenizer.pad_token_id is not None
    assert len(tokenizer) == cfg.vocab_size


@shipped
def test_card_and_metrics():
    card = (MODEL_DIR / "README.md").read_text()
    assert card.count(ROUTING_HEADING) == 1 and ROUTING_MARKER not in card  # filled by seqmoe.arch.tiny.traces
    assert "| seqmoe-tiny (held-out stdlib files" in card
    ev = json.loads((MODEL_DIR / "metrics.json").read_text())["evaluation"]
    assert ev["heldout_perplexity"] < 0.25 * ev["unigram_perplexity"]
    assert (MODEL_DIR / "loss_curve.png").stat().st_size < 200_000


@shipped
def test_greedy_generation_from_python_prompt(model, tokenizer):
    ids = tokenizer("import os\n\n\ndef main(", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tokenizer.decode(out[0, ids.shape[1]:]), str)


@shipped
def test_heldout_perplexity_below_unigram(model, heldout):
    corpus = stdlib_corpus()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    counts_from = encode_docs(tok, [corpus.read(f) for f in corpus.train_files[::10]])  # a tenth of the training files
    nll, n = heldout_nll(model, heldout, CONTEXT, max_windows=16)
    u_nll, u_n = unigram_nll(counts_from, heldout[:16 * CONTEXT], CONTEXT, model.config.vocab_size)
    assert n == u_n > 1000
    assert math.exp(nll / n) < 0.5 * math.exp(u_nll / u_n)


@shipped
def test_routing_reuse_above_random(model, heldout):
    ids = torch.from_numpy(heldout[:4 * CONTEXT].astype(np.int64)).view(4, CONTEXT)
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True).router_logits
    K, E = model.config.num_experts_per_tok, model.config.num_experts
    reuse = []
    for layer in logits:
        top = layer.view(4, CONTEXT, E).topk(K, dim=-1).indices  # [B, T, K]
        same = (top[:, 1:, :, None] == top[:, :-1, None, :]).any(-1).float()  # expert also used by the previous token
        reuse.append(float(same.mean()))
    assert np.mean(reuse) > 1.5 * K / E


def test_seeded_training_is_reproducible():
    from transformers import OlmoeForCausalLM

    tokens = np.random.default_rng(0).integers(2, 64, size=2000).astype(np.int32)
    cfg = dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
               num_experts=4, num_experts_per_tok=2, max_position_embeddings=16)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = OlmoeForCausalLM(model_config(64, **cfg))
        rows = train_model(model, tokens, steps=3, batch=2, context=16, seed=0, log_every=1, progress=False)
        runs.append([(r["train_loss"], r["aux_loss"]) for r in rows])
    assert len(runs[0]) == 3 and runs[0] == runs[1]
    assert all(a > 0 for _, a in runs[0])


def test_training_rejects_short_stream():
    from transformers import OlmoeForCausalLM

    model = OlmoeForCausalLM(model_config(64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, num_experts=4))
    with pytest.raises(UserError, match="fewer than one window"):
        train_model(model, np.zeros(10, np.int32), steps=1, context=16, progress=False)


def test_shipped_routing_is_structured_like_real_models():
    """The demo traces: reuse between consecutive tokens well above random (K/E), skewed popularity."""
    from seqmoe.arch.tiny.traces import load_demo_traces
    from seqmoe.trace.stats import summarize

    for trace in load_demo_traces():
        assert trace.meta.model == "seqmoe-tiny" and (trace.num_layers, trace.num_experts, trace.top_k) == (8, 32, 4)
        s = summarize(trace)
        assert s["token_reuse"] > 2 * s["token_reuse_random"]
        assert np.mean(s["skew_top_share"]) > 2 * s["skew_top_share_uniform"]


@pytest.mark.slow
def test_seqmoe_beats_lru_on_seqmoe_tiny_routing(tmp_path, monkeypatch):
    """The issue's check, as `seqmoe demo` runs it (trains the forecaster for 2.5 minutes)."""
    from seqmoe.cli.demo import run_demo

    monkeypatch.setenv("SEQMOE_CACHE", str(tmp_path / "cache"))
    rows = {(r["system"], r["residency"]): r for r in run_demo(out_dir=tmp_path)}
    ours, lru = rows["seqmoe", 0.45], rows["on-demand-lru", 0.45]
    assert ours["hit_rate"] > lru["hit_rate"] and ours["time_s"] < lru["time_s"]
