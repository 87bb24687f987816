"""Every Python list of a config key's choices is the schema's enum (workflow/schemas/config.schema.yaml
is the one source of every key): a value added to the schema but not to the code, or the other way
round, fails here instead of at run time."""

import pytest

from dflashpipe.jobs.settings import on_server, schema_enum


def _twins():
    from dflashpipe.decode.speculative import TARGET_STEPS
    from dflashpipe.decode.static_target import ATTENTION
    from dflashpipe.export.write import ARCHITECTURES
    from dflashpipe.drafter.model import ARCHS, COMPILE_MODES, LAYER_TYPES
    from dflashpipe.inputs.data import CHAT_FORMATS
    from dflashpipe.inputs.tokenize import CUT_REPLIES
    from dflashpipe.stages.expand import BACKENDS, DECODE_STEPS

    return {
        "datasets.*.format": CHAT_FORMATS,
        "evaluate.target_step": TARGET_STEPS,
        "evaluate.attention": ATTENTION,
        "drafter.arch": ARCHS,
        "train.compile": COMPILE_MODES,
        "drafter.layer_types": LAYER_TYPES,
        "expand.backend": BACKENDS,
        "expand.decode_step": DECODE_STEPS,
        "tokenize.cut_replies": CUT_REPLIES,
        "drafter.arch (exported architectures)": ARCHITECTURES,
    }


@pytest.mark.parametrize("key", list(_twins()))
def test_python_twin_is_the_schema_enum(key):
    assert list(_twins()[key]) == list(schema_enum(key.split(" ")[0]))


def test_server_backends_are_backends():
    backends = schema_enum("expand.backend")
    assert [b for b in backends if on_server(b)] == ["openai"]
    assert not on_server("auto")  # auto resolves to a backend that runs the target in the job
