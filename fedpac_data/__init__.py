"""Data files installed with the project: the embedded demo dataset (``mnist_5k.u8.xz``, see
README.md here), read by ``common.data.load_embedded_mnist``.

A package of its own rather than a file in ``common/``: the app bundle (FAB) that Flower ships
to every ClientApp holds text files only (``.py``, ``.toml``, ``.md``, ``.json``, ...) and goes
with every task, so the 0.7 MB of binary data stays out of it; the ClientApp finds this package
where the project is installed (``pip install`` or ``make``), its ``common`` in the FAB or not.
"""
