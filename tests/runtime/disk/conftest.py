"""Keep torch on one thread (the test machine is shared); tiny checkpoints saved once per session."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """saved(arch) -> the folder of `tiny_model(arch)` saved with save_pretrained (once per arch)."""
    from tests.arch.collect.tiny_models import save_tiny_checkpoint

    folders = {}

    def get(arch: str):
        if arch not in folders:
            folders[arch] = tmp_path_factory.mktemp(arch)
            save_tiny_checkpoint(arch, folders[arch], tokenizer=False)
        return folders[arch]

    return get
