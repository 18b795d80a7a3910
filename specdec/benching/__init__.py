"""What bench.py measures with, beside its lesson (warm-up, interleaved repeats, medians, tau):

    methods.py   the catalogue: every method --methods names, built on the loaded model (ours
                 through decode.reply with generate.py's generate(), transformers', llama.cpp's)
    in_vllm.py   vLLM's engine beside ours (vllm, vllm-medusa, vllm-eagle3), each in a process
                 of vLLM's own python running vllm_worker.py
    batches.py   --batch-size: the methods that batch, at each size, and their table
    report.py    the tables, the plots, an online method's cost in words

The command line that calls them is specdec/commands/bench.py.
"""
