"""The ``lorapool`` command.

Subcommands live in their own modules and are imported only when invoked, so
that producer-side commands work on an install without torch.
"""

from importlib import import_module

import click

# command name -> "module:attribute"
COMMANDS = {
    "prepare-model": "lorapool.cli.model:prepare_model",
    "demo": "lorapool.cli.demo:demo",
    "bench": "lorapool.cli.bench:bench",
    "audit": "lorapool.cli.audit:audit",
    "audit-writer": "lorapool.cli.audit:audit_writer",
    "worker": "lorapool.cli.queue:worker",
    "submit": "lorapool.cli.queue:submit",
    "abort": "lorapool.cli.queue:abort",
    "status": "lorapool.cli.queue:status",
    "adapters": "lorapool.cli.queue:adapters",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(name for name in COMMANDS if self.get_command(ctx, name) is not None)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            return getattr(import_module(module), attr)
        except (ImportError, AttributeError):
            return None


@click.group(cls=LazyGroup)
def cli():
    """lorapool: many LoRA adapters over one base LLM, behind a Redis queue."""


def main():
    cli()


if __name__ == "__main__":
    main()
