"""Keep torch on one thread: the test machine is shared."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)
