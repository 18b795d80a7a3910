"""The commands' command lines: the flags, checks and modes of generate.py, train.py and bench.py,
which import these and call them."""
