"""The daemon's composition root: the node, its front ends (the local API, the coordinator session) and the
service-manager hooks, wired together and run until SIGINT/SIGTERM. `provider start` checks its settings and
the state directory, then calls `run`."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import time

from . import __version__, logs, paths
from .jobs import JobError
from .group.spec import GroupSpec
from .settings import Settings
from .startup import EXIT_CONFIG

EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the engine died; the service manager restarts the node
GC_OFF_AT_MOST_S = 30.0  # `provider start` turns the collector off until its model serves: never longer than this


async def run(settings: Settings, *, local: bool, group: GroupSpec | None = None) -> int:
    """Run the node with its front ends until SIGINT/SIGTERM, then drain: engine first, listeners last. As rank 0
    of a node group (`group`), first join the other ranks; the model then loads split across them."""
    from .local.dashboard import login_link
    from .local.server import load_or_mint_token, start_control_socket, start_local_api
    from .models.default import primary_models
    from .machine import decide_node_budget, node_step_tokens
    from .node import Node, build_models
    from . import status_file, systemd_notify

    session = identity = None
    if settings.coordinator:  # check the URL, then the key, before loading anything
        from coordinator_client.channel import plan_channel
        from coordinator_client.identity import Identity
        from coordinator_client.session import CoordinatorSession

        plan_channel(settings.coordinator, allow_insecure=settings.allow_insecure_coordinator)
        identity = Identity.load_or_create()
    token, token_path = load_or_mint_token() if local and settings.auth else (None, None)

    membership = None
    if group is not None:  # rank 0 of a node group: join the other ranks before anything loads (docs/group.md)
        from .group.member import join_with_settings

        membership = (await asyncio.to_thread(join_with_settings, settings, group, decide_node_budget(settings),
                                              node_step_tokens(settings))).membership
    node = Node(settings, build_models(settings, primary_models(settings), group=membership), group=membership)
    if identity is not None:
        session = CoordinatorSession(node, settings, identity)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    collector_on = loop.call_later(GC_OFF_AT_MOST_S, gc.enable)  # a download or a slow load: on again meanwhile
    engine_failed = []
    node.on_engine_failure(lambda why: loop.call_soon_threadsafe(lambda: (engine_failed.append(why), stop.set())))
    node.start()
    model_id = node.resolve_model(None)

    def session_state() -> str | None:
        if session is None:
            return None
        return "rejected" if session.rejected else "connected" if session.welcomed.is_set() else "connecting"

    def session_detail() -> dict | None:
        if session is None:
            return None
        return {"state": session_state(), "connected_since": session.connected_since,
                "sessions": session.stats.sessions, "jobs_received": session.jobs.stats.jobs_received,
                "outcomes_sent": session.jobs.stats.outcomes_sent, "spot_checks": session.verdicts.as_dict()}

    mode = "+".join(m for m, on in (("local", local), ("coordinator", session)) if on)
    # What `provider status` and the node's page say of the daemon beside NodeStatus (status_file.DaemonFacts).
    facts = status_file.DaemonFacts(pid=os.getpid(), started=time.time(), mode=mode,
                                    coordinator=settings.coordinator or None, session=session_detail)
    runner = url = None
    if local and membership is None:
        # Listen at once: /health says `loading` and a request waits for the model, instead of a refused
        # connection, while it loads. The API's line (its URL) still comes once the model serves.
        node.loading = True
        runner, url = await start_local_api(node, settings.bind, settings.port, token, facts=facts)
        facts.local_url = url
        print(f"provider {__version__}: loading {model_id}; health at {url}/health", flush=True)
    # The command line's way in (`provider generate`), with or without the TCP API, and after it: on its runner.
    runner, control = await start_control_socket(node, token, runner, facts=facts)
    loading = asyncio.create_task(systemd_notify.while_loading(model_id))
    try:
        await node.preload(model_id)  # load and warm up before saying we are ready
    except JobError as e:
        if settings.model:  # the model asked for by name must load; any other may fail alone
            await _abandon_start(node, runner, control)
            raise
        logs.get("daemon").warning("default_model_unavailable", model=model_id, cause=e.cause.value)
        print(f"provider: {model_id} is unavailable: {e.message}", file=sys.stderr, flush=True)
    finally:
        loading.cancel()
        node.loading = False
    try:
        for pinned in node.pinned_ids():  # loaded now and never unloaded: one that cannot load stops the start
            await node.load_model(pinned)
    except JobError:
        await _abandon_start(node, runner, control)
        raise
    if membership is not None:
        node.group_ready()
    # What is loaded now lives as long as the process (modules, the model's tokenizer and its vocabulary):
    # out of the collector's sight, a full collection scans only what requests allocate. Without this, traffic
    # that allocates (large request bodies, schemas) paused every stream for 100 ms and more per collection.
    # `provider start` runs its imports and this first load with the collector off (cli._start): it is turned on
    # here, after the freeze, as CPython's docs advise for gc.freeze.
    gc.freeze()
    gc.enable()
    collector_on.cancel()

    def on_signal() -> None:  # the first drains; a second cuts what still runs
        if not stop.is_set():
            stop.set()
            st = node.status()
            busy, grace = st.active_jobs + st.queued_jobs, settings.shutdown_grace_s
            print(f"provider: stopping: {busy} job{'s' * (busy != 1)} in flight get up to {grace:g} s to finish; "
                  "Ctrl-C again to cut them now" if busy else "provider: stopping", file=sys.stderr, flush=True)
        elif not hurried:
            hurried.append(asyncio.ensure_future(asyncio.to_thread(node.engine.stop, 0.0)))  # grace ends now
            print("provider: cutting the jobs in flight now", file=sys.stderr, flush=True)

    hurried: list = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    print(f"provider {__version__}: serving {model_id}", flush=True)
    if local:
        if url is None:
            runner, url = await start_local_api(node, settings.bind, settings.port, token, runner, facts=facts)
            facts.local_url = url
        print(f"  local OpenAI-compatible API at {url}/v1", flush=True)
        print(f"  token file: {token_path}  (send: Authorization: Bearer <its contents>)" if token_path
              else "  auth: off (--no-auth)", flush=True)
        print(f"  dashboard: {login_link(runner.app, url)}"
              + ("  (one-time login link; `provider status --open` prints a new one)" if token_path else ""),
              flush=True)
    session_task = None
    if session is not None:
        session_task = asyncio.create_task(session.run(stop))
        if not local:  # a coordinator-only node that was refused for good has nothing left to do
            session_task.add_done_callback(lambda _: session.rejected and stop.set())
        print(f"  coordinator: {settings.coordinator} as {identity.node_id}", flush=True)

    def describe() -> str:
        st = node.status()
        return (f"{st.health}, {mode}; models {','.join(st.resident) or 'none'}; {st.active_jobs} active, "
                f"{st.queued_jobs} queued" + (f"; coordinator {session_state()}" if session else ""))

    async def publish_status() -> None:  # for `provider status`
        while not stop.is_set():
            status_file.write(paths.state_dir(), facts.snapshot(node.status()))
            try:
                await asyncio.wait_for(stop.wait(), 2.0)
            except asyncio.TimeoutError:
                pass

    watchdog = asyncio.create_task(systemd_notify.notify_loop(node, stop, describe))
    publisher = asyncio.create_task(publish_status())

    await stop.wait()
    systemd_notify.notify("STOPPING=1")
    await node.stop(grace_s=settings.shutdown_grace_s)
    if session_task is not None:
        await session_task
    await runner.cleanup()
    _remove(control)
    watchdog.cancel()
    await publisher
    status_file.remove(paths.state_dir())
    if session is not None and session.rejected and not local:
        print(f"provider: the coordinator refused this node for good: {session.rejected}", file=sys.stderr,
              flush=True)
        return EXIT_CONFIG
    if engine_failed:
        print(f"provider: the engine failed ({engine_failed[0]}); exiting for the service manager to restart "
              "the node", file=sys.stderr, flush=True)
        return EXIT_ENGINE_FAILED
    return 0


async def _abandon_start(node, runner, control) -> None:
    """A model the start must have could not load: the node, its listeners and its socket go before the error."""
    await node.stop(grace_s=0)
    await runner.cleanup()
    _remove(control)


def _remove(control) -> None:
    """The control socket's file, once its listener closed (the instance lock is still held)."""
    if control is not None:
        control.unlink(missing_ok=True)
