"""``lorapool bench NAME``: runs a benchmark script from benchmarks/ in a source checkout."""

import runpy
import sys
from pathlib import Path

import click

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Scripts whose plain name would shadow a module when run (python benchmarks/X.py puts
# benchmarks/ first on sys.path): the stdlib's queue, Hugging Face's kernels.
SCRIPTS = {
    "queue": "queue_path",
    "kernels": "kernel_ops",
    "queue-path": "queue_gpu",
    "gpu": "gpu_check",
}


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,  # `bench NAME --help` is the script's help, not this command's
)
@click.argument("name", required=False)
@click.pass_context
def bench(ctx, name):
    """Run benchmarks/NAME.py (engine, kernels, audit_writer, ...) with the remaining options.

    `lorapool bench NAME --help` prints the script's own options."""
    if name in (None, "--help", "-h"):
        click.echo(ctx.get_help())
        ctx.exit(0 if name else 2)
    if not (BENCHMARKS.is_dir() and (BENCHMARKS.parent / "pyproject.toml").is_file()):
        raise click.UsageError(
            "benchmarks need a source checkout of lorapool: they are scripts in its "
            "benchmarks/ folder, which an installed package does not carry. Clone the "
            "repository and run `lorapool bench NAME` (or python benchmarks/NAME.py) there."
        )
    script = BENCHMARKS / f"{SCRIPTS.get(name, name)}.py"
    if not script.is_file():
        command_of = {script: command for command, script in SCRIPTS.items()}
        scripts = [p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_")]
        names = sorted(command_of.get(stem, stem) for stem in scripts)
        raise click.UsageError(f"no benchmark {name!r} in {BENCHMARKS} (have: {', '.join(names)})")
    sys.argv = [str(script), *ctx.args]
    runpy.run_path(str(script), run_name="__main__")
