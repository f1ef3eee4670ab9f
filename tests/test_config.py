"""The configurations and the commands built on them: every option checked once, when the configuration
is built, and a bad option of `generate`, `serve` or `bench-runtime` is one line `seqmoe: error: ...`,
exit code 2, before torch (so before any model, trace or forecaster) is loaded.

Run: pytest tests/test_config.py -q
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from seqmoe.cli import build_parser
from seqmoe.cli.args import field_docs
from seqmoe.config import CLI, LoadConfig, OffloadConfig
from seqmoe.base.errors import UserError

BAD_OPTIONS = [
    (["--miss", "nope"], "unknown miss path 'nope'"),
    (["--control", "nope"], "control must be one of"),
    (["--threads", "-1"], "threads must be >= 1"),
    (["--threads", "0"], "threads must be >= 1"),
    (["--dtype", "int3"], "unknown dtype 'int3'"),
    (["--model", "/nonexistent/model"], "no model at /nonexistent/model"),
    (["--train", "/nonexistent/train.safetensors"], "no train trace at"),
    (["--residency-typo", "0.5"], "unrecognized arguments"),
]
RUNTIME_ONLY = [  # options bench-runtime does not take (it compares systems and residencies on its own cost model)
    (["--residency", "1.5"], "residency must be in (0, 1]"),
    (["--residency", "abc"], "invalid float value: 'abc'"),
    (["--system", "nope"], "unknown system 'nope'"),
    (["--system", "belady"], "cannot run live"),
    (["--system", "affinity-style"], "learns from a routing trace"),
    (["--system", "seqmoe-hybrid"], "needs the seq2seq forecaster"),
    (["--routing", "cache-aware"], "needs its budget max_kl"),
    (["--hardware", "tpu-v9"], "unknown hardware profile 'tpu-v9'"),
    (["--bandwidth", "-1"], "bandwidth must be > 0"),
    (["--device", "tpu"], "not supported by the runtime"),
]
COMMANDS = {"generate": ["--prompt", "x"], "serve": [], "bench-runtime": []}

_PROBE = """
import contextlib, io, json, sys
from seqmoe.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    out.append([code, err.getvalue()])
print(json.dumps({"runs": out, "torch": "torch" in sys.modules}))
"""


def test_bad_offload_options_fail_in_one_line_before_anything_loads():
    cases = [(cmd, flags, msg) for cmd in COMMANDS for flags, msg in BAD_OPTIONS + (RUNTIME_ONLY if cmd != "bench-runtime" else [])]
    cases += [("bench-runtime", ["--residencies", "0.25,1.5"], "residency must be in (0, 1]"),
              ("bench-runtime", ["--systems", "belady"], "cannot run live"),
              ("bench-runtime", ["--system", "seqmoe"], "unrecognized arguments: --system"),
              ("generate", ["--prompt", ""], "--prompt is empty"),
              ("generate", ["--graph", "--control", "inline"], "--graph needs --control thread"),
              ("generate", ["--graph", "--eager"], "--graph and --eager"),
              ("serve", ["--graph"], "unrecognized arguments: --graph")]
    argvs = [[cmd, *COMMANDS[cmd], *flags] for cmd, flags, _ in cases]
    res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs)], capture_output=True, text=True, timeout=120)
    got = json.loads(res.stdout)
    assert not got["torch"]  # nothing was loaded: every error came from the options alone
    for (cmd, flags, msg), (code, err) in zip(cases, got["runs"]):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("seqmoe: error: ") and msg in lines[0], \
            (cmd, flags, err)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_offload_flags_are_generated_from_the_configurations(command):
    """Each flag's help is its field's docstring; the commands that offload share them (bench-runtime
    a subset: it builds its own cost model)."""
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    flags = {a.dest: a for a in sub._actions}
    for cls in (LoadConfig, OffloadConfig):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get(CLI, True) or f.name not in flags:
                assert command == "bench-runtime" or not f.metadata.get(CLI, True), f.name
                continue
            if command == "bench-runtime" and f.name in ("threads", "train", "predictor"):
                continue  # its own default (one thread) and meanings (collected, trained briefly)
            assert flags[f.name].help.replace("%%", "%").startswith(docs[f.name]), f.name
            assert flags[f.name].default == f.default, f.name  # None until given: the config fills its default
            own = getattr(cls, "DEFAULTS", {}).get(f.name)
            assert own is None or f"(default: {own})" in flags[f.name].help, f.name
    assert sub.format_help()  # help texts are argparse format strings


@pytest.mark.parametrize("kwargs, match", [
    (dict(residency=True), "residency must be a number"),
    (dict(residency="0.5"), "residency must be a number"),
    (dict(residency=0.3, expert_memory="1GiB"), "not both"),
    (dict(expert_memory="12GB"), "is not a size"),
    (dict(expert_memory=0), "more than 0 bytes"),
    (dict(expert_dtype="int3"), "unknown expert precision"),
    (dict(miss="copy", control="inline", routing="exact", max_kl=0.1), "exact routing has none"),
    (dict(hardware="measured", bandwidth=1e9), "measured cost model"),
    (dict(emulate_link=True, device="cuda"), "emulated link is for a CPU pool"),
    (dict(system="oracle-prefetch"), "cannot run live"),
])
def test_offload_config_checks_its_values(kwargs, match):
    with pytest.raises(UserError, match=match):
        OffloadConfig(**kwargs)


def test_the_defaults_resolve_in_one_place():
    cfg = OffloadConfig()
    assert cfg.control_on("cuda") == "thread" and cfg.control_on("cpu") == "inline"
    assert cfg.miss_with("inline") == "auto" and cfg.miss_with("thread") == "copy"
    assert OffloadConfig(miss="cpu").miss_with("thread") == "cpu"
    assert OffloadConfig(system="belady", replay=object(), train=object()).system == "belady"  # forced routing
    assert OffloadConfig().for_graph().control == "thread"
    assert LoadConfig().model == "seqmoe-tiny"


def test_a_residency_given_with_an_expert_memory_budget_is_refused_in_sim_and_runtime():
    from seqmoe.config import OffloadConfig, SimConfig

    for cls, extra in ((SimConfig, {"trace": "-"}), (OffloadConfig, {})):
        with pytest.raises(UserError, match="not both"):
            cls(residency=0.3, expert_memory="1GiB", **extra)
        assert cls(expert_memory="1GiB", **extra).expert_memory == "1GiB"
