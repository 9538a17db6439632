"""The `atomesh` command line.

`atomesh launch` takes the SMG / ATOMesh flags. Its options are generated from GatewayConfig, so a
setting exists once: as a config field, a flag, a YAML key and a line of the reference docs.
SMG's multi-value flags (`--worker-urls A B`, `--prefill URL PORT`) are rewritten into click's
repeated form by `normalize_argv` before parsing.
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Sequence
from enum import Enum
from typing import Any

import click
import typer
from click.core import ParameterSource

from atomesh import __version__
from atomesh.config import FLAG_ALIASES, ConfigError, GatewayConfig, flag_name, load_config

app = typer.Typer(help="atomesh: an LLM inference gateway with P/D disaggregation.", no_args_is_help=True,
                  add_completion=False)


@app.command()
def version() -> None:
    """Print the atomesh version."""
    typer.echo(__version__)


# ---------------------------------------------------------------------------- launch
def _strip_optional(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(_strip_optional(annotation)) is list


def _metavar(annotation: Any) -> str:
    inner = _strip_optional(annotation)
    if typing.get_origin(inner) is list:
        inner = typing.get_args(inner)[0]
    inner = typing.get_args(inner)[0] if typing.get_origin(inner) is typing.Annotated else inner
    if isinstance(inner, type) and issubclass(inner, Enum):
        return "|".join(str(m.value) for m in inner)
    return {int: "INT", float: "FLOAT", str: "TEXT"}.get(inner, "VALUE")


def _multi_value_flags() -> set[str]:
    flags = set()
    for name, field in GatewayConfig.model_fields.items():
        if _is_list(field.annotation) and name not in ("prefill", "decode"):
            flags.add(flag_name(name))
    return flags


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite SMG's multi-value flags into repeated single-value flags click understands.

    `--worker-urls A B` -> `--worker-urls A --worker-urls B`;
    `--prefill URL 8998` / `--prefill URL none` -> `--prefill "URL 8998"` / `--prefill "URL none"`.
    """
    multi = _multi_value_flags()
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in multi:
            values = []
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
            if not values:
                out.append(arg)  # click reports the missing value
            for v in values:
                out += [arg, v]
        elif arg == "--prefill" and i < len(argv):
            spec = argv[i]
            i += 1
            if i < len(argv) and (argv[i].isdigit() or argv[i].lower() == "none"):
                spec += " " + argv[i]
                i += 1
            out += [arg, spec]
        else:
            out.append(arg)
    return out


def _parse_prefill(spec: str) -> dict[str, Any]:
    parts = spec.split()
    if len(parts) not in (1, 2):
        raise ConfigError(f"--prefill: expected 'URL [BOOTSTRAP_PORT|none]', got {spec!r}")
    port: int | None = None
    if len(parts) == 2 and parts[1].lower() != "none":
        port = int(parts[1])
        if not 1 <= port <= 65535:
            raise ConfigError(f"--prefill: bootstrap port {port} is out of range")
    return {"url": parts[0], "bootstrap_port": port}


def _launch_options() -> list[click.Option]:
    options = []
    for name, field in GatewayConfig.model_fields.items():
        decls = [flag_name(name), *FLAG_ALIASES.get(name, ()), name]
        annotation = _strip_optional(field.annotation)
        default = field.get_default(call_default_factory=True)
        shown = default.value if isinstance(default, Enum) else default
        help_text = (field.description or "") + ("" if shown in (None, [], False) else f"  [default: {shown}]")
        if annotation is bool:
            options.append(click.Option(decls, is_flag=True, default=False, help=help_text))
        else:
            options.append(click.Option(decls, multiple=_is_list(annotation), default=None,
                                        metavar=_metavar(field.annotation), help=help_text))
    return options


def _launch(**params: Any) -> None:
    ctx = click.get_current_context()
    flags: dict[str, Any] = {}
    for name, value in params.items():
        if ctx.get_parameter_source(name) is not ParameterSource.COMMANDLINE:
            continue
        flags[name] = list(value) if isinstance(value, tuple) else value
    try:
        if "prefill" in flags:
            flags["prefill"] = [_parse_prefill(s) for s in flags["prefill"]]
        config = load_config(flags)
    except (ConfigError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    start_gateway(config)


def start_gateway(config: GatewayConfig) -> None:
    """Set up logging, then run the gateway until it is stopped; exit 1 with one line if it cannot start."""
    from atomesh.app import run
    from atomesh.gateway import StartupError
    from atomesh.logs import setup_logging
    from atomesh.policies import PolicyNotAvailable

    setup_logging(config.log_level.value, config.json_log, config.log_dir)
    try:
        run(config)
    except (StartupError, PolicyNotAvailable) as e:
        click.echo(f"atomesh: error: {e}", err=True)
        sys.exit(1)


launch_command = click.Command(
    "launch", callback=_launch, params=list(_launch_options()),
    help="Start the gateway (flags as SMG / ATOMesh; see docs/configuration.md).",
    context_settings={"max_content_width": 110},
)


@app.command(
    "launch", add_help_option=False,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def launch(ctx: typer.Context) -> None:
    """Start the gateway (flags as SMG / ATOMesh; `atomesh launch --help` lists them)."""
    # The options are generated from GatewayConfig, so a plain click command parses them.
    launch_command.main(args=normalize_argv(ctx.args), prog_name="atomesh launch")


def main(argv: Sequence[str] | None = None) -> None:
    app(args=list(sys.argv[1:] if argv is None else argv), prog_name="atomesh")


if __name__ == "__main__":
    main()
