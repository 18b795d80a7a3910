"""specdec: the machinery of speculative decoding with draft heads, beside the lesson's seven files
at the top of the repository (model.py, heads.py, tree.py, verify.py, generate.py, train.py,
bench.py), which it imports and never the other way round.

    engines/     decode.py: generate.py's ladder for many rows and every drafter, and the chat;
                 engine.py: many prompts at once
    rows.py      model.py's forward over rows of their own lengths
    drafters.py  the Drafter protocol and every drafter beyond the heads
    fast/        the fast paths, each the tested twin of a readable function
    loading/     models, heads and tokenizers (checkpoint.py); what a user may name (catalog.py)
    training/    what surrounds train.py's loop, Medusa-2, PaSS's tokens, online learning
    commands/    the entry scripts' command lines: generate.py's and bench.py's flags, checks, main
    benching/    what bench.py measures with: its catalogue of methods, batches, tables and plots
    api.py       the Python API: from specdec.api import load (README.md, "From Python")
    cli.py, ctrl_c.py, terminal.py, tuning.py, export.py   the command line and its tools
    lesson.py    the lesson's files it imports by name, checked to be the repository's

Importing the package imports nothing: specdec.ctrl_c must load before torch does.
"""
