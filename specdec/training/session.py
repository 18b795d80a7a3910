"""Everything around train.py's loop for one run, called once after each step: the tokens trained
on and the progress bar, the held-out evaluation every --eval-every steps, a checkpoint every
--save-every seconds and at the end, and Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption, or
torchrun passing a signal on), which only raise a flag: the loop finishes its step, the session
saves and exits with 128 + the signal number (130 for Ctrl-C). Stopping mid-step could save a
half-updated optimizer. Under torchrun every rank has a session; a signal on any rank stops every
rank after the same step, and rank 0 alone evaluates, saves and prints.

    session = Session(heads, opt, data, plan, out, args, bf16, weights)   # resumes if asked
    with session:                   # the signals are caught inside
        train.train(..., session.step, session)     # the loop calls session.after_step
    session.finish()                # the final evaluation: eval.json

Tests: tests/test_train.py (resume after a crash, kill -9 or Ctrl-C, NaN), tests/test_train_cli.py.
"""

import json
import os
import signal
import sys
import time

import torch.distributed as dist
from tqdm import tqdm

from specdec import cli
from specdec.training import distributed, resume
from specdec.training.evaluate import curve_point, eval_line, evaluate


class StopFlag:
    """Within `with StopFlag() as stop:`, SIGINT and SIGTERM set stop.signum instead of stopping."""

    def __enter__(self):
        self.signum = 0
        self.previous = {s: signal.signal(s, self.catch) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def catch(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def logger(rank):
    """print to stderr on rank 0; nothing on the others."""
    if rank == 0:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    return lambda msg: None


class Session:
    """One run's state beside the weights: the step reached (self.step: 0, or the checkpoint's with
    --resume), the progress (assistant tokens trained on, the learning curve), the last checkpoint.
    args: the run's flags (eval_every, save_every, resume, batch_tokens, seed, heads); weights: the
    base model's digest (dataset.weights_digest)."""

    def __init__(self, heads, opt, data, plan, out, args, bf16, weights):
        self.rank, self.world = distributed.rank_and_world()
        self.log = logger(self.rank)
        self.heads, self.opt, self.data, self.plan = heads, opt, data, plan
        self.out, self.args, self.bf16 = out, args, bf16
        self.device = plan.device
        self.identity = resume.run_identity(heads, data, args, self.world, bf16, weights)
        self.step = self.saved_step = 0
        # assistant tokens trained on (head 1's targets, all ranks), the held-out evaluations so far
        self.progress = {"tokens": 0, "curve": []}
        # every rank reads it: --out must be shared
        if args.resume and os.path.exists(os.path.join(out, resume.STATE)):
            self.step, self.progress = resume.load_checkpoint(out, heads, opt, self.identity)
            self.saved_step = self.step
            self.log(f"[train] resumed from step {self.step} in {out}")
        elif args.resume:
            self.log(f"[train] no checkpoint in {out}; starting from step 0")

    def __enter__(self):
        self.stop = StopFlag().__enter__()
        self.bar = tqdm(
            total=self.plan.total,
            initial=self.step,
            desc=f"train {self.args.heads}",
            unit="step",
            disable=None if self.rank == 0 else True,
        )
        self.t0, self.tokens0, self.last_save = time.time(), self.progress["tokens"], time.time()
        return self

    def __exit__(self, *exc):
        self.stop.__exit__(*exc)
        self.bar.close()

    def evaluate(self):
        """The heads on the held-out conversations (left in eval mode)."""
        heads, plan = self.heads.eval(), self.plan
        return evaluate(
            heads, self.data, plan.held_out, plan.to_kept, self.args, self.device, self.bf16
        )

    def after_step(self, step, loss, batch):
        """The loop has just finished `step` steps, the last with `loss` on `batch`."""
        self.step = step
        tokens = int(batch["valid"][..., 0].sum())
        self.progress["tokens"] += distributed.total(tokens, self.device, self.world)
        # assistant tokens/s, all ranks
        rate = (self.progress["tokens"] - self.tokens0) / (time.time() - self.t0)
        self.bar.update(1)
        self.bar.set_postfix_str(f"loss {loss:.3f}, {rate:.0f} tok/s")
        # a signal on any rank stops every rank after this same step
        signum = distributed.total(self.stop.signum, self.device, self.world, dist.ReduceOp.MAX)
        total, rank0 = self.plan.total, self.rank == 0
        if rank0 and step % self.args.eval_every == 0 and step < total and not signum:
            report = self.evaluate()
            self.heads.train()
            self.progress["curve"].append(curve_point(step, self.progress["tokens"], report))
            self.log("\n" + eval_line(step, report))
        if rank0 and (
            signum or step == total or time.time() - self.last_save >= self.args.save_every
        ):
            self.save(step)
            # no progress bar (output not a terminal, e.g. a log file): a line per checkpoint
            if self.bar.disable:
                self.log(
                    f"[train] step {step}/{total}, loss {loss:.3f}, {rate:.0f} assistant "
                    "tok/s; checkpoint written"
                )
        if signum:
            # nobody exits (and gets the others killed) before rank 0 has saved
            distributed.barrier(self.world)
            self.log(
                f"\n[train] stopped by signal {signum} at step {step}; checkpoint written to "
                f"{self.out} (--resume continues)"
            )
            sys.exit(128 + signum)

    def save(self, step):
        """The checkpoint of `step`; a disk that cannot take it (full) stops the run with one line
        naming --out and what is kept."""
        try:
            resume.save_checkpoint(
                self.out, self.heads, self.opt, step, self.identity, self.progress
            )
        except OSError as e:
            raise resume.saving_failed(self.out, step, e, self.kept()) from None
        self.last_save = time.time()
        self.saved_step = step

    def kept(self):
        """What a run stopped by an error leaves: its last checkpoint, if any."""
        return resume.kept_line(self.out, self.saved_step)

    def finish(self):
        """Rank 0: the final held-out evaluation, into eval.json with the learning curve."""
        if self.rank != 0:
            return
        report = self.evaluate()
        point = curve_point(self.step, self.progress["tokens"], report)
        report["curve"] = self.progress["curve"] + [point]
        os.makedirs(self.out, exist_ok=True)
        try:
            with open(os.path.join(self.out, "eval.json"), "w") as f:
                json.dump(report, f, indent=1)
        except OSError as e:
            raise cli.UsageError(
                f"--out {self.out}: writing eval.json failed ({e.strerror or e}); the heads "
                f"of step {self.step} are in it; free some space to keep the evaluation"
            ) from None
        self.log(eval_line(self.step, report))
        self.log(
            f"[train] done: {cli.plural(self.step, 'step')}, {time.time() - self.t0:.0f} s; "
            f"heads in {self.out}; chain tau {report['chain_tau']:.2f}"
        )
