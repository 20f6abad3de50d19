"""`provider` command line: start the node, and the one-shot commands (models, generate, bench, doctor, ...)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
from pathlib import Path

from .. import __version__, logs, paths
from .cli_help import explain
from ..group.spec import GroupSpec, GroupSpecError, group_spec, public_addresses
from ..jobs import JobError
from ..net import is_loopback
from ..settings import Settings, SettingsError
from ..startup import EXIT_CONFIG, InstanceLock, StartupError



def _config_option() -> argparse.ArgumentParser:
    """`--config FILE`, accepted before or after any subcommand (the innermost one given wins)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", type=Path, default=argparse.SUPPRESS,
                   help="TOML config file (default: $XDG_CONFIG_HOME/provider/config.toml)")
    return p


def _add_start(sub) -> None:
    p = sub.add_parser("start", help="run the node (local API and/or coordinator session)", parents=[_config_option()])
    p.add_argument("--local", action="store_const", const=True,
                   help="serve a local OpenAI-compatible API (config: local = true)")
    p.add_argument("--coordinator", help="coordinator URL (grpcs://host:port; grpc:// only on loopback)")
    p.add_argument("--model", help="model directory or Hugging Face repo id (default: the bundled model)")
    p.add_argument("--drafter", help="Gemma 4 assistant or same-vocabulary draft model for --model")
    p.add_argument("--speculation", choices=["auto", "on", "off"], help="node speculation policy (default auto)")
    p.add_argument("--port", type=int, help="local API port (default 8080; 0 picks a free one)")
    p.add_argument("--bind", help="local API address (default 127.0.0.1)")
    p.add_argument("--no-auth", dest="auth", action="store_const", const=False, help="serve without a bearer token")
    p.add_argument("--allow-unauthenticated-public", action="store_const", const=True,
                   help="with --no-auth, allow a non-loopback --bind (anyone who reaches the port can use the node)")
    p.add_argument("--group", dest="group_hostfile", metavar="HOSTFILE",
                   help="join a node group: MLX's ring hostfile, one [\"ip:port\"] per rank (docs/group.md)")
    p.add_argument("--rank", dest="group_rank", type=int, help="this machine's rank in --group (0 serves)")
    p.add_argument("--group-backend", choices=["ring", "jaccl"], help="MLX's distributed backend (default ring)")
    p.add_argument("--group-secret", dest="group_secret_file", metavar="FILE",
                   help="the group's secret (`provider group init`; default: group-secret in the state directory)")
    p.add_argument("--group-public-network", dest="group_allow_public_network", action="store_const", const=True,
                   help="let the group's links run over public addresses (MLX's ring is unauthenticated plaintext: "
                   "only over a VPN or a network that is private in fact)")
    p.add_argument("--group-split", choices=["auto", "tensor", "pipeline"],
                   help="split the model by its layers' projections (tensor) or by layers (pipeline); default auto")
    p.add_argument("--log-format", choices=["auto", "console", "json"],
                   help="log lines for a person (console) or a collector (json); auto: console on a terminal")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="the least that is logged (default info)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="provider", description="Provider node for decentralized LLM inference.",
                                     parents=[_config_option()])
    parser.add_argument("--version", action="version", version=f"provider {__version__}")
    parser.set_defaults(config=None)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_start(sub)
    config = [_config_option()]
    from .model_commands import add_parser as add_models_parser

    add_models_parser(sub, config)
    bench = sub.add_parser("bench", help="speculation off vs on, k in a range, same model and prompts; JSON out")
    bench.add_argument("--model", type=Path, help="target model directory (default: the bundled model)")
    bench.add_argument("--drafter", type=Path, help="assistant or draft model (default: the bundled pair's)")
    bench.add_argument("--k", default="1,2,3,4", help="draft tokens per round to try (default 1,2,3,4)")
    bench.add_argument("--prompts", type=int, default=10, help="how many of the built-in prompts")
    bench.add_argument("--prompts-file", help="one prompt per line instead of the built-in ones")
    bench.add_argument("--max-tokens", type=int, default=64, help="per prompt and run")
    bench.add_argument("--temperature", type=float, default=0.7, help="of the sampled runs (default 0.7)")
    bench.add_argument("--out", type=Path, default=Path("bench.json"), help="where the JSON report goes")
    bench.add_argument("--plot", type=Path, help="also write tokens/s and tokens per target forward against k "
                       "as a PNG (needs matplotlib: the `plot` extra)")
    sub.add_parser("doctor", help="check platform, memory budget, models and coordinator",
                   parents=config).add_argument("--json", action="store_true", help="the report as one JSON object")
    svc = sub.add_parser("service", help="install, remove or inspect the systemd unit / launchd agent")
    ssub = svc.add_subparsers(dest="service_command", required=True)
    for name, what in (("install", "render the unit (or plist) from deploy/ with this installation's paths"),
                       ("uninstall", "remove the installed unit (config and state are kept)"),
                       ("status", "whether the unit is installed and the daemon runs")):
        sp = ssub.add_parser(name, help=what)
        kind = sp.add_mutually_exclusive_group()
        kind.add_argument("--system", dest="kind", action="store_const", const="systemd-system",
                          help="a system unit (/etc/systemd/system; needs root) instead of a user unit")
        kind.add_argument("--launchd", dest="kind", action="store_const", const="launchd",
                          help="a launchd agent (the default on macOS)")
        kind.add_argument("--systemd-user", dest="kind", action="store_const", const="systemd-user",
                          help="a systemd user unit (the default on Linux)")
        if name == "install":
            sp.add_argument("--dry-run", action="store_true", help="print what would be written; write nothing")
        if name == "status":
            sp.add_argument("--json", action="store_true", help="the state as one JSON object (no systemctl output)")
    grp = sub.add_parser("group", help="node groups: one provider on several machines (docs/group.md)")
    gsub = grp.add_subparsers(dest="group_command", required=True)
    chk = gsub.add_parser("check", help="run on every rank: whether the ranks reach each other, each link's latency "
                          "and bandwidth through MLX's backend")
    chk.add_argument("hostfile", help="MLX's ring hostfile, as for `provider start --group`")
    chk.add_argument("--rank", type=int, default=-1, help="this machine's rank (default: MLX_RANK)")
    chk.add_argument("--backend", choices=["ring", "jaccl"], default="ring", help="MLX's distributed backend")
    chk.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for every rank to join (default 30)")
    chk.add_argument("--payload-mb", type=int, default=32, help="bandwidth payload in MiB (default 32)")
    chk.add_argument("--json", action="store_true", help="the report as JSON (rank 0)")
    chk.add_argument("--group-secret", metavar="FILE", default="",
                     help="the group's secret (default: group_secret_file, else group-secret in the state directory)")
    init = gsub.add_parser("init", help="write a new group secret, to copy to every rank of the group")
    init.add_argument("--out", default="", help="where (default: group_secret_file, else the state directory)")
    init.add_argument("--force", action="store_true", help="replace an existing secret")
    from .generate import add_parser as add_generate
    from .verify_cli import add_parser as add_verify

    add_generate(sub)
    add_verify(sub)
    st = sub.add_parser("status", help="the running daemon's state (models, jobs, memory), from its state directory")
    st.add_argument("--json", action="store_true", help="the whole status as JSON")
    st.add_argument("--open", action="store_true",
                    help="print a new one-time login link to the node's page and open it in this machine's browser")
    return explain(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "start":
        # Leave without the interpreter's teardown, as the one-shot commands do: MLX 0.32's CPU backend can
        # abort there (SIGABRT) after a clean drain, and the service manager would read a crash.
        _leave(_start(args))
    if args.command == "doctor":
        from . import doctor

        _leave(doctor.run(lambda: Settings.load(config_file=args.config), args.json))
    if args.command == "generate":
        from . import generate

        _leave(generate.run(args))
    if args.command == "verify":
        from . import verify_cli

        _leave(verify_cli.run(args))
    if args.command == "models":
        return _models(args)
    if args.command == "group":
        _leave(_group_init(args) if args.group_command == "init" else _group_check(args))
    if args.command == "status":
        if args.open:
            from . import page_link

            return page_link.run()
        from . import status_command

        return status_command.run(args)
    if args.command == "service":
        from . import service_files

        s = service_files.plan(args.kind or service_files.default_kind(), dict(os.environ), Path.home(),
                               service_files.installed_provider())
        if args.service_command == "install":
            return service_files.install(s, dry_run=args.dry_run)
        if args.service_command == "uninstall":
            return service_files.uninstall(s)
        return service_files.status(s, as_json=args.json)
    if args.command == "bench":
        from . import bench
        from ..models.default import default_pair

        if args.model is None:
            args.model, default_drafter = default_pair()
            args.drafter = args.drafter or default_drafter
        _leave(bench.main(args))
    return 2


def _leave(code: int) -> None:
    """End a finished one-shot command that ran MLX on worker threads (the loader's) without the interpreter's
    teardown: there, MLX 0.32's CPU backend sometimes aborts ("terminate called without an active exception",
    exit 134, one run in four of `provider doctor` here) after all the work and output are done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _group_init(args: argparse.Namespace) -> int:
    from ..group.secret import GroupSecretError, create_secret, secret_path

    try:
        path = secret_path(args.out or Settings.load(config_file=getattr(args, "config", None)).group_secret_file)
        create_secret(path, force=args.force)
    except (SettingsError, GroupSecretError) as e:
        print(f"provider: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote a new group secret to {path} (0600): copy it to every rank of the group, over a channel you "
          f"trust, and keep it 0600 there (group_secret_file names it, if not in the state directory)")
    return 0


def _group_check(args: argparse.Namespace) -> int:
    import json

    from ..group.check import describe, run_check
    from ..engine.collective import GroupLost
    from ..group.member import EXIT_GROUP_LOST

    if not 0 < args.timeout <= 3600 or not 1 <= args.payload_mb <= 1024:
        print("provider: --timeout must be in (0, 3600] s and --payload-mb in 1..1024", file=sys.stderr)
        return EXIT_CONFIG
    try:
        secret_file = args.group_secret or Settings.load(config_file=getattr(args, "config", None)).group_secret_file
        spec = group_spec(args.hostfile, args.rank, args.backend, os.environ, secret_file)
    except (GroupSpecError, SettingsError) as e:
        print(f"provider: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        report = run_check(spec, args.timeout, args.payload_mb << 20)
    except GroupLost as e:
        print(f"provider: group check failed on rank {spec.rank}: {e}", file=sys.stderr)
        return EXIT_GROUP_LOST
    if spec.leader:
        print(json.dumps(report.as_dict(), indent=2) if args.json else describe(report, spec))
    else:
        mine = [f"{x.src} -> {x.dst} {x.latency_ms_p50:.3f} ms" for x in report.links if spec.rank in (x.src, x.dst)]
        print(f"rank {spec.rank}: joined and measured ({'; '.join(mine)}); rank 0 prints the report")
    return 1 if report.problems else 0


def _models(args: argparse.Namespace) -> int:
    from . import model_commands

    try:
        settings = Settings.load(config_file=args.config)
    except SettingsError as e:
        print(f"provider: configuration error: {e}", file=sys.stderr)
        return 2
    return model_commands.run(args, settings)


def _start(args: argparse.Namespace) -> int:
    cli = {"model": args.model, "drafter": args.drafter, "speculation": args.speculation,
           "port": args.port, "bind": args.bind, "auth": args.auth,
           "allow_unauthenticated_public": args.allow_unauthenticated_public,
           "log_format": args.log_format, "log_level": args.log_level, "coordinator": args.coordinator,
           "local": args.local, "group_hostfile": args.group_hostfile, "group_rank": args.group_rank,
           "group_backend": args.group_backend, "group_split": args.group_split,
           "group_secret_file": args.group_secret_file, "group_allow_public_network": args.group_allow_public_network}
    try:
        settings = Settings.load(cli=cli, config_file=args.config)
    except SettingsError as e:
        print(f"provider: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    public_without_auth = settings.local and not settings.auth and not is_loopback(settings.bind)
    if public_without_auth and not settings.allow_unauthenticated_public:
        print(f"provider: refusing to start: auth is off and --bind {settings.bind} is not a loopback address, so "
              "anyone who reaches the port could use the node; drop --no-auth, bind to 127.0.0.1, or pass "
              "--allow-unauthenticated-public if that is really meant", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format, file=settings.log_file)
    if public_without_auth:
        logs.get("cli").warning("unauthenticated_public_api", bind=settings.bind)
        print(f"provider: WARNING: serving without auth on {settings.bind}; anyone who reaches the port can use "
              "this node", file=sys.stderr)
    try:
        group = group_spec(settings.group_hostfile, settings.group_rank, settings.group_backend, os.environ,
                           settings.group_secret_file)
    except GroupSpecError as e:
        print(f"provider: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    public = public_addresses(group.hosts) if group is not None else []
    if public and not settings.group_allow_public_network:
        print(f"provider: refusing to start: the group's hostfile has public addresses ({', '.join(public)}); MLX's "
              "ring carries tensors unauthenticated and in plaintext, so a group's links must be a private network "
              "(a Thunderbolt bridge, a dedicated switch, a VPN). Pass --group-public-network (group_allow_public_"
              "network = true) if these links are private in fact", file=sys.stderr)
        return EXIT_CONFIG
    if group is not None and not group.leader:  # a follower: no session, no listener (docs/group.md)
        return _follow(settings, group)
    if not settings.local and not settings.coordinator:
        print("provider: nothing to run; pass --local or --coordinator URL, or set `local = true` or `coordinator` "
              "in the config",
              file=sys.stderr)
        return EXIT_CONFIG
    # The collector stays off through the imports (MLX, mlx-lm, transformers, aiohttp: ~0.45 s of collections
    # over objects that all live as long as the process) and the default model's load; daemon.run freezes what
    # is loaded and turns it on once the model serves, or after GC_OFF_AT_MOST_S whatever happens (issue 43).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run_daemon(settings, group)
    finally:
        if collecting:
            gc.enable()


def _run_daemon(settings: Settings, group: GroupSpec | None) -> int:
    from .. import daemon, startup

    failures: tuple = (JobError, PermissionError)
    if settings.coordinator:  # a local-only node never loads the gRPC stack (protobuf, grpc, its keys)
        from coordinator_client.channel import ChannelError
        from coordinator_client.identity import IdentityError

        failures += (IdentityError, ChannelError)

    lock = InstanceLock(paths.state_dir())
    try:  # before any model loads: each failure is one line and its exit code
        startup.check_state_dir(paths.state_dir())
        lock.acquire()
        if settings.local:
            startup.check_port_free(settings.bind, settings.port)
    except StartupError as e:
        print(f"provider: cannot start: {e.message}", file=sys.stderr)
        return e.exit_code
    from ..engine.collective import GroupLost
    from ..group.member import EXIT_GROUP_LOST

    try:
        return asyncio.run(daemon.run(settings, local=settings.local, group=group))
    except failures as e:
        print(f"provider: cannot start: {getattr(e, 'message', e)}", file=sys.stderr)
        return 1
    except GroupLost as e:
        print(f"provider: cannot start: {e}", file=sys.stderr)
        return EXIT_GROUP_LOST
    finally:
        lock.release()


def _follow(settings: Settings, group: GroupSpec) -> int:
    from .. import startup
    from ..group.follower import run_follower

    lock = InstanceLock(paths.state_dir())
    try:
        startup.check_state_dir(paths.state_dir())
        lock.acquire()
    except StartupError as e:
        print(f"provider: cannot start: {e.message}", file=sys.stderr)
        return e.exit_code
    try:
        return run_follower(settings, group)
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
