"""The ``lorapool`` command.

Subcommands live in their own modules and are imported only when invoked, so
that producer-side commands work on an install without torch. A command whose
extra is not installed stays listed and says which extra to install.
"""

from importlib import import_module

import click

# command name -> "module:attribute"
COMMANDS = {
    "prepare-model": "lorapool.cli.model:prepare_model",
    "demo": "lorapool.cli.demo:demo",
    "bench": "lorapool.cli.bench:bench",
    "audit": "lorapool.cli.audit:audit",
    "audit-writer": "lorapool.cli.audit_writer:audit_writer",
    "worker": "lorapool.cli.queue:worker",
    "submit": "lorapool.cli.queue:submit",
    "abort": "lorapool.cli.queue:abort",
    "status": "lorapool.cli.queue:status",
    "trim": "lorapool.cli.queue:trim",
    "dashboard": "lorapool.cli.dashboard:dashboard",
    "exporter": "lorapool.cli.exporter:exporter",
    "adapters": "lorapool.cli.queue:adapters",
    "serve": "lorapool.cli.serve:serve",
    "keys": "lorapool.cli.keys:keys",
    "batch": "lorapool.cli.batch:batch",
}

# top-level module -> the extra of pyproject.toml that installs it
EXTRAS = {
    "torch": "worker",
    "triton": "worker",
    "transformers": "worker",
    "safetensors": "worker",
    "tokenizers": "worker",
    "numpy": "worker",
    "sqlalchemy": "audit",
    "alembic": "audit",
    "psycopg": "audit",
    "fastapi": "gateway",
    "uvicorn": "gateway",
}


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """What to install for a module that an extra provides; None for any other module."""
    root = (exc.name or "").split(".")[0]
    if root not in EXTRAS:
        return None
    return f"{root} is not installed: pip install 'lorapool[{EXTRAS[root]}]'"


def unavailable(name: str, message: str) -> click.Command:
    """A stand-in for a command whose module cannot be imported: listed, and says why."""

    @click.command(name=name, short_help=f"(unavailable: {message})", add_help_option=False)
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args):
        raise click.ClickException(f"lorapool {name}: {message}")

    return command


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return show_envvars(getattr(import_module(module), attr))
        except ModuleNotFoundError as exc:
            message = missing_extra(exc)
            if message is None:
                raise
            return unavailable(name, message)

    def invoke(self, ctx):
        # Commands import their heavy dependencies when they run, not when listed.
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            message = missing_extra(exc)
            if message is None:
                raise
            raise click.ClickException(message) from exc
        except Exception as exc:  # noqa: BLE001 - a set-up error gets one line, not a traceback
            message = setup_error(exc)
            if message is None:
                raise
            raise click.ClickException(message) from None


def show_envvars(command: click.Command) -> click.Command:
    """Every option of ``command`` (and its subcommands) that an environment variable
    sets says which in ``--help`` ("[env var: REDIS_URL]")."""
    for param in command.params:
        if isinstance(param, click.Option):
            param.show_envvar = True
    for sub in getattr(command, "commands", {}).values():
        show_envvars(sub)
    return command


def setup_error(exc: Exception) -> str | None:
    """One line for an error of the deployment, not of the code: a Redis user refused
    by its ACL or by its password, an audit schema that cannot be made; else None."""
    from lorapool.connection import refusal

    message = refusal(exc)
    if message is None and type(exc).__name__ == "AuthenticationError":
        message = f"Redis refused the login: {exc} (check the user and password of the URL)"
    if message is None and type(exc).__name__ == "SchemaMissing":
        message = str(exc)
    return message


@click.group(cls=LazyGroup)
def cli():
    """lorapool: many LoRA adapters over one base LLM, behind a Redis queue."""
    from lorapool.embedded import join_inherited

    join_inherited()  # a child of the process that started the shared embedded Redis


def main():
    cli()


if __name__ == "__main__":
    main()
