import sys

import pytest

from seqmoe.base.errors import UserError


def test_a_model_load_without_transformers_names_generate_and_the_checkout_install(monkeypatch):
    from seqmoe.arch.collect import models

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(UserError) as e:
        models._import_hf()
    msg = str(e.value)
    assert "trace collection" not in msg  # generate, serve and bench load models too
    assert "pip install 'seqmoe[hf]'" in msg and "pip install -e '.[hf]'" in msg
