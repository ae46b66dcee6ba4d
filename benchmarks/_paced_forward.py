"""A ``lorapool`` command whose engine's forward is paced as a GPU's: the queue-speed
stand-in of the real worker (real scheduler, fair share, sampler, outputs, publishing),
for benchmarks on a box without a device.

The model's forward (``ModelRunner._forward``) is replaced by a sleep of ``--step-ms``
plus ``--token-us`` a decode token plus ``--prefill-us`` a prefill position (the
defaults are ``benchmarks/tenants.py``'s, derived there from the GPU kit's figures for a
~1B Llama on an H200: 3.32 ms at batch 64) and returns zero logits: every token equally
likely, so greedy requests take token 0 and sampled ones draw uniformly. The sleep
frees the CPU and the GIL as a device synchronisation does; everything around the
forward runs as it does on a GPU's host, on this box's CPU. What it does not stand for:
the tokens (no model runs), a GPU's CUDA graphs or its device-side argmax.

    python benchmarks/_paced_forward.py [--step-ms 3] [--token-us 5] [--prefill-us 10] \\
        -- worker --model DIR ...         # the rest: lorapool's own arguments
"""

from __future__ import annotations

import argparse
import sys
import time


def paced(step_s: float, token_s: float, prefill_s: float):
    """The stand-in for ``ModelRunner._forward``."""
    import torch

    def forward(runner, batch):
        lengths = torch.diff(batch.query_start_loc).tolist()
        decode = sum(1 for n in lengths if n == 1)
        prefill = sum(lengths) - decode
        time.sleep(step_s + decode * token_s + prefill * prefill_s)
        rows = batch.logits_indices.numel()
        return torch.zeros((rows, runner.model.vocab_size), dtype=torch.float32)

    return forward


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: _paced_forward.py [options] -- LORAPOOL-ARGS (no '--' given)")
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--token-us", type=float, default=5.0)
    parser.add_argument("--prefill-us", type=float, default=10.0)
    args = parser.parse_args(argv[:cut])

    from lorapool.cli.main import main as lorapool
    from lorapool.engine.model_runner import ModelRunner

    ModelRunner._forward = paced(args.step_ms / 1e3, args.token_us / 1e6, args.prefill_us / 1e6)
    sys.argv = ["lorapool", *argv[cut + 1 :]]
    lorapool()


if __name__ == "__main__":
    main()
