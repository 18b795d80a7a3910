"""specdec: the machinery of speculative decoding with draft heads, and its Python API (api.py).

    import specdec
    sd = specdec.load()                          # the default model and its shipped hydra++ heads
    print(sd.generate("Give me three tips for staying focused while studying.").text)

From outside the repository, put its folder (the one holding generate.py) on Python's path:
PYTHONPATH=/path/to/specdec (README.md, "From Python").

The API's names are read from api.py when first asked for, not when the package is imported: a
script that needs only cli.py (the convention, which imports nothing of the project) does not load
the model code with it.
"""

API = ("load", "Decoder", "Reply", "Chat", "APIError")  # specdec.load, ..., from api.py
__all__ = list(API)


def __getattr__(name):  # called for a name the package does not hold yet (PEP 562)
    if name in API:
        from specdec import api

        return getattr(api, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
