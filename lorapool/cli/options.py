"""Options several commands share, and how a command's options become its config.

May import: click and ``lorapool``'s torch-free modules.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from lorapool.lifecycle.keys import DEFAULT_PREFIX, MAX_SHARDS

redis_option = click.option(
    "--redis-url",
    envvar="REDIS_URL",
    default=None,
    help="Redis URL (default: $REDIS_URL, else an embedded Redis)",
)
prefix_option = click.option(
    "--prefix", default=DEFAULT_PREFIX, show_default=True, help="key prefix"
)

shards_option = click.option(
    "--shards",
    envvar="LORAPOOL_SHARDS",
    default=0,
    show_default=True,
    type=click.IntRange(0, MAX_SHARDS),
    help="the pool's shard count on a Redis Cluster, the same for every producer, worker "
    "and audit writer of the pool (default: $LORAPOOL_SHARDS; 0: one standalone Redis)",
)


def count_option(flag: str, default: int, help: str, dest: str | None = None, least: int = 1):
    """An option taking an integer of at least ``least`` (1), its default shown."""
    names = (flag, dest) if dest else (flag,)
    return click.option(
        *names, default=default, show_default=True, type=click.IntRange(min=least), help=help
    )


def seconds_option(flag: str, dest: str, default: float, help: str, least: float, most=None):
    """An option taking seconds from ``least`` to ``most`` (None: no bound), its default
    shown, stored under ``dest`` (the config's ``..._s`` field)."""
    return click.option(
        flag,
        dest,
        type=click.FloatRange(least, most),
        default=default,
        show_default=True,
        help=f"seconds {help}",
    )


def finite_share(param, value: float) -> float:
    """A share in (0, 1] (``click.FloatRange`` lets NaN pass its comparisons)."""
    if value != value:
        raise click.BadParameter("must be a number in (0, 1]", param=param)
    return value


def optional_option(flag: str, type: click.ParamType, help: str):
    """An option that is unset (None) unless given; ``help`` says what unset means."""
    return click.option(flag, type=type, default=None, help=help)


def flag_option(flag: str, help: str):
    """An on/off flag, off unless given."""
    return click.option(flag, is_flag=True, help=help)


def repeated_option(flag: str, dest: str, help: str, **kwargs):
    """An option that may be given several times, collected under ``dest``."""
    return click.option(flag, dest, multiple=True, help=f"{help} (repeatable)", **kwargs)


def config_from(cls: type, options: dict[str, Any], **given: Any):
    """The dataclass ``cls`` from the command's options named as its fields, and
    ``given`` for the fields whose option is named otherwise or needs converting. A
    value it refuses (ValueError) is a usage error naming the option where the error
    names its field (``config_fields.OptionError``), not a traceback."""
    names = {field.name for field in dataclasses.fields(cls)}
    try:
        return cls(**{**{k: v for k, v in options.items() if k in names}, **given})
    except ValueError as exc:
        raise _refused(exc) from None


def _refused(exc: ValueError) -> click.UsageError:
    ctx = click.get_current_context(silent=True)
    field = getattr(exc, "field", None)
    params = ctx.command.params if ctx is not None else []
    names = {field, field.removesuffix("_s")} if field else set()  # --result-timeout: ..._s
    param = next((p for p in params if p.name in names), None)
    if param is not None:
        return click.BadParameter(str(exc), ctx=ctx, param=param)
    return click.UsageError(str(exc), ctx=ctx)


webhook_allow_option = click.option(
    "--webhook-allow",
    "webhook_allow",
    multiple=True,
    envvar="LORAPOOL_WEBHOOK_ALLOW",
    help="a network (10.1.0.0/16) or host name (hooks.internal, *.internal) that webhooks "
    "may call although internal; every other loopback, private, link-local, unique-local, "
    "multicast or metadata address is refused (repeatable; $LORAPOOL_WEBHOOK_ALLOW, "
    "space-separated)",
)


LISTEN_DEFAULT = "127.0.0.1"


def host_option(flag: str = "--host", old: str | None = None, help: str = "address to listen on"):
    """A listen address option, the same name in every command (``--host``; the worker's
    metrics: ``--metrics-host``), 127.0.0.1 by default (``0.0.0.0`` to listen on every
    interface). ``old``: a former name, still accepted but not shown."""
    dest = flag.lstrip("-").replace("-", "_")

    def current(ctx: click.Context, param: click.Parameter, value):
        given = ctx.meta.get(f"old:{dest}")
        source = ctx.get_parameter_source(param.name)
        return (
            given if given is not None and source == click.core.ParameterSource.DEFAULT else value
        )

    def decorate(command):
        command = click.option(
            flag, dest, default=LISTEN_DEFAULT, show_default=True, help=help, callback=current
        )(command)
        if old is not None:
            command = click.option(
                old,
                hidden=True,
                expose_value=False,
                is_eager=True,
                callback=lambda ctx, _p, v: (
                    ctx.meta.__setitem__(f"old:{dest}", v) if v is not None else None
                ),
            )(command)
        return command

    return decorate


def _grammar_limits(ctx, param, value):
    from lorapool.grammar_limits import GrammarLimits

    try:
        return GrammarLimits.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


grammar_limit_option = click.option(
    "--grammar-limit",
    "grammar_limits",
    multiple=True,
    callback=_grammar_limits,
    metavar="NAME=VALUE",
    help="a limit on structured outputs' grammars and schemas, refused with a 400 naming "
    "it: max_grammar_rules (512), max_grammar_depth (64), max_schema_refs (256), "
    "max_ref_depth (32), max_schema_depth (64), max_enum_values (1024), max_regex_chars "
    "(4096), compile_timeout_s (10), compile_memory_mb (2048) (repeatable)",
)
