"""Turns a SuperNode into a hostile site, for ``tests/test_site_identity.py``: with this folder on
its PYTHONPATH, while the file that ``FEDPAC_TEST_PAD_REPLIES`` names exists, every training reply
its ClientApp sends carries that file's number of extra random bytes (random, so that no chunk
repeats another: every byte travels). The site is otherwise honest, with its own registered key:
what a compromised site's machine could send."""

import os

_FLAG = os.environ.get("FEDPAC_TEST_PAD_REPLIES", "")


def _install() -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel  # only in the hostile site's processes
    from flwr.app import Array, ArrayRecord  # pylint: disable=import-outside-toplevel
    from flwr.clientapp import client_app  # pylint: disable=import-outside-toplevel

    call = client_app.ClientApp.__call__

    def padded(self, message, context):  # noqa: ANN001, ANN202  # ClientApp.__call__'s
        reply = call(self, message, context)
        if os.path.exists(_FLAG) and message.metadata.message_type == "train" and reply.has_content():
            with open(_FLAG) as flag:
                size = int(flag.read())
            reply.content["padding"] = ArrayRecord({"bytes": Array(np.random.default_rng().integers(
                0, 256, size, dtype=np.uint8))})
        return reply

    client_app.ClientApp.__call__ = padded


if _FLAG:
    try:
        _install()
    except ImportError:  # a process of the site that has no Flower (its shell tools)
        pass
