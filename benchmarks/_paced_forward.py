"""A ``lorapool`` command whose engine's forward is paced as a GPU's: the queue-speed
stand-in of the real worker (real scheduler, fair share, sampler, outputs, publishing),
for benchmarks on a box without a device.

The model's forward (``ModelRunner._forward``) is replaced by a sleep of ``--step-ms``
plus ``--token-us`` a decode token plus ``--prefill-us`` a prefill position (the
defaults are ``benchmarks/tenants.py``'s, derived there from the GPU kit's figures for a
~1B Llama on an H200: 3.32 ms at batch 64) and returns zero logits: every token equally
likely, so greedy requests take token 0 and sampled ones draw uniformly. The sleep
frees the CPU and the GIL as a device synchronisation does; everything around the
forward runs as it does on a GPU's host, on this box's CPU. ``--queued``: the device
is one the host queues work on, as a GPU's (``QueuedDevice``): the host goes on after the
forward and waits only when it reads the step back, so host work placed there (the
sampler's launches; async output processing's outputs) overlaps the device's step. What
neither stands for: the tokens (no model runs), a GPU's CUDA graphs or its device-side
argmax.

    python benchmarks/_paced_forward.py [--step-ms 3] [--token-us 5] [--prefill-us 10] \\
        -- worker --model DIR ...         # the rest: lorapool's own arguments
"""

from __future__ import annotations

import argparse
import sys
import time


def _work_s(batch, step_s: float, token_s: float, prefill_s: float) -> float:
    """The device's time for ``batch``: a step, plus a decode token's or a prefill
    position's time for each of its tokens."""
    lengths = batch.query_start_loc.diff().tolist()
    decode = sum(1 for n in lengths if n == 1)
    return step_s + decode * token_s + (sum(lengths) - decode) * prefill_s


def paced(step_s: float, token_s: float, prefill_s: float):
    """The stand-in for ``ModelRunner._forward``."""
    import torch

    def forward(runner, batch):
        time.sleep(_work_s(batch, step_s, token_s, prefill_s))
        rows = batch.logits_indices.numel()
        return torch.zeros((rows, runner.model.vocab_size), dtype=torch.float32)

    return forward


class QueuedDevice:
    """A device the host queues work on (``--queued``), as a GPU's: the forward returns
    its zero logits at once, the device is busy with the step until ``ready`` (from when
    it was handed over, or from its previous step's end), and the host waits only where
    the engine reads the step back: the greedy path's ``finite_argmax(...).tolist()``,
    the sampler's results. ``busy``: seconds of work handed over."""

    def __init__(self, step_s: float, token_s: float, prefill_s: float = 0.0):
        self.step_s, self.token_s, self.prefill_s = step_s, token_s, prefill_s
        self.ready = self.busy = 0.0

    def forward(self, runner, batch):
        import torch

        work = _work_s(batch, self.step_s, self.token_s, self.prefill_s)
        self.ready = max(time.perf_counter(), self.ready) + work
        self.busy += work
        rows = batch.logits_indices.numel()
        return torch.zeros((rows, runner.model.vocab_size), dtype=torch.float32)

    def wait(self, until: float | None = None) -> None:
        """Until the work handed over so far is done (or ``until``, a time of ``ready``)."""
        left = (self.ready if until is None else until) - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def install(self) -> None:
        """Into this process's engine: its forward, and waits at its read-backs (async
        scheduling's waits for its own step only: work queued after it runs on)."""
        from lorapool.engine import async_scheduling, llm_engine, sampler
        from lorapool.engine.model_runner import ModelRunner

        ModelRunner._forward = lambda runner, batch: self.forward(runner, batch)
        argmax, results = llm_engine.finite_argmax, sampler._results

        def queued_argmax(logits):  # queued: the wait comes with its .tolist()
            return _ReadBack(argmax(logits), self)

        def read_results(*args, **kwargs):
            self.wait()
            return results(*args, **kwargs)

        llm_engine.finite_argmax, sampler._results = queued_argmax, read_results
        async_scheduling.read_back = lambda tensor: _ReadBack(tensor, self)


class _ReadBack:
    """A step's tokens, read back once the device has done the work handed over so far."""

    def __init__(self, tensor, device: QueuedDevice):
        self.tensor, self.device, self.done = tensor, device, device.ready

    def tolist(self):
        self.device.wait(self.done)
        return self.tensor.tolist()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: _paced_forward.py [options] -- LORAPOOL-ARGS (no '--' given)")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--token-us", type=float, default=5.0)
    parser.add_argument("--prefill-us", type=float, default=10.0)
    parser.add_argument(
        "--queued", action="store_true", help="a device the host queues work on (QueuedDevice)"
    )
    args = parser.parse_args(argv[:cut])

    from lorapool.cli.main import main as lorapool
    from lorapool.engine.model_runner import ModelRunner

    times = (args.step_ms / 1e3, args.token_us / 1e6, args.prefill_us / 1e6)
    if args.queued:
        QueuedDevice(*times).install()
    else:
        ModelRunner._forward = paced(*times)
    sys.argv = ["lorapool", *argv[cut + 1 :]]
    lorapool()


if __name__ == "__main__":
    main()
