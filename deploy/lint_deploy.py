#!/usr/bin/env python3
"""Static checks of the Dockerfile and docker-compose.yml, for machines without a Docker
engine (and without hadolint): the Dockerfile rules below are a small subset of hadolint's
plus this project's own requirements; the compose checks are the project's requirements
(GPU reservations, NCCL settings, health check, grace period) on top of what
`docker compose config` validates. Exit 0 when everything holds, 1 with one line per problem.

usage: lint_deploy.py dockerfile PATH | compose PATH | k8s DIR
"""
import json
import os
import re
import shlex
import sys

INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}


def logical_lines(text):
    """(line number, instruction, arguments), continuation lines joined, comments dropped."""
    out, buf, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((start, word, rest.strip()))
        buf = ""
    if buf:
        out.append((start, "<unterminated>", buf))
    return out


def lint_dockerfile(path):
    problems = []
    root = os.path.dirname(os.path.abspath(path))
    text = open(path, encoding="utf-8").read()
    lines = logical_lines(text)

    def bad(number, message):
        problems.append(f"{path}:{number}: {message}")

    global_args = set()
    stages = []  # dicts: name, instructions
    for number, word, rest in lines:
        if word == "<unterminated>":
            bad(number, "instruction ends with a line continuation")
            continue
        if word.upper() != word:
            bad(number, f"instruction '{word}' should be upper case")
        word = word.upper()
        if word not in INSTRUCTIONS:
            bad(number, f"unknown instruction '{word}'")
            continue
        if word == "FROM":
            parts = rest.split()
            image = parts[0]
            name = None
            if len(parts) == 3 and parts[1].upper() == "AS":
                name = parts[2]
            elif len(parts) != 1:
                bad(number, "FROM takes IMAGE [AS NAME]")
            resolved = re.sub(r"\$\{(\w+)[^}]*\}", lambda m: "X", image)
            for var in re.findall(r"\$\{?(\w+)", image):
                if var not in global_args:
                    bad(number, f"FROM uses ${var}, not declared by an ARG before the first FROM")
            if image != "scratch" and ":" not in resolved.split("/")[-1] and "@" not in image:
                bad(number, f"FROM {image}: pin a tag")
            if resolved.endswith(":latest"):
                bad(number, f"FROM {image}: do not use the latest tag")
            if name and any(s["name"] == name for s in stages):
                bad(number, f"stage name '{name}' used twice")
            stages.append({"name": name, "line": number, "ins": []})
            continue
        if not stages:
            if word == "ARG":
                global_args.add(rest.split("=")[0].strip())
            else:
                bad(number, f"{word} before the first FROM")
            continue
        stages[-1]["ins"].append((number, word, rest))

    if not stages:
        bad(1, "no FROM")
        return problems

    for index, stage in enumerate(stages):
        for number, word, rest in stage["ins"]:
            if word in ("CMD", "ENTRYPOINT") and rest.startswith("["):
                try:
                    json.loads(rest)
                except ValueError:
                    bad(number, f"{word}: exec form is not a valid JSON array")
            if word == "WORKDIR" and not rest.startswith(("/", "$")):
                bad(number, "WORKDIR should be absolute")
            if word == "RUN":
                if re.search(r"\bsudo\b", rest):
                    bad(number, "RUN uses sudo")
                if re.search(r"apt-get\s+(dist-)?upgrade", rest):
                    bad(number, "RUN apt-get upgrade: pin the base image instead")
                if re.search(r"apt-get\s+install", rest):
                    if not re.search(r"\s-y\b|--yes|--assume-yes", rest):
                        bad(number, "apt-get install without -y")
                    if "--no-install-recommends" not in rest:
                        bad(number, "apt-get install without --no-install-recommends")
                    if "apt-get update" not in rest:
                        bad(number, "apt-get install without apt-get update in the same RUN")
                    if "rm -rf /var/lib/apt/lists" not in rest:
                        bad(number, "apt-get install without rm -rf /var/lib/apt/lists/*")
                for script in re.findall(r"(?:^|&&|;)\s*((?:deploy|scripts)/[\w./-]+\.sh)", rest):
                    full = os.path.join(root, script)
                    if not os.path.isfile(full):
                        bad(number, f"RUN {script}: no such file in the build context")
                    elif not os.access(full, os.X_OK):
                        bad(number, f"RUN {script}: not executable")
            if word in ("COPY", "ADD"):
                args = shlex.split(rest)
                flags = [a for a in args if a.startswith("--")]
                paths = [a for a in args if not a.startswith("--")]
                if len(paths) < 2:
                    bad(number, f"{word} needs a source and a destination")
                    continue
                source_stage = None
                for flag in flags:
                    if flag.startswith("--from="):
                        source_stage = flag.split("=", 1)[1]
                if source_stage is not None:
                    earlier = [s["name"] for s in stages[:index]]
                    if source_stage not in earlier and not (
                            source_stage.isdigit() and int(source_stage) < index):
                        bad(number, f"{word} --from={source_stage}: no earlier stage of that name")
                else:
                    if word == "ADD" and not re.match(r"https?://", paths[0]):
                        bad(number, "use COPY for local files (ADD only for URLs or archives)")
                    for src in paths[:-1]:
                        if src in (".", "./"):
                            continue
                        if not os.path.exists(os.path.join(root, src)):
                            bad(number, f"{word} {src}: not in the build context")

    final = stages[-1]["ins"]
    words = [w for _, w, _ in final]
    users = [r for _, w, r in final if w == "USER"]
    if not users:
        bad(stages[-1]["line"], "the runtime stage never sets USER (runs as root)")
    elif users[-1].split(":")[0] in ("root", "0"):
        bad(stages[-1]["line"], "the runtime stage's last USER is root")
    exposed = " ".join(r for _, w, r in final if w == "EXPOSE").split()
    if "50051" not in [p.split("/")[0] for p in exposed]:
        bad(stages[-1]["line"], "the runtime stage does not EXPOSE 50051")
    if len(exposed) < 2:
        bad(stages[-1]["line"], "the runtime stage should EXPOSE the metrics port too")
    health = [(n, r) for n, w, r in final if w == "HEALTHCHECK"]
    if not health:
        bad(stages[-1]["line"], "the runtime stage has no HEALTHCHECK")
    for number, rest in health:
        cmd = rest.split("CMD", 1)
        if len(cmd) != 2:
            bad(number, "HEALTHCHECK without CMD")
            continue
        body = cmd[1].strip()
        if body.startswith("["):
            try:
                argv = json.loads(body)
            except ValueError:
                bad(number, "HEALTHCHECK CMD: exec form is not a valid JSON array")
                continue
            if not argv or argv[0] != "decode-indexer-health":
                bad(number, "HEALTHCHECK should run decode-indexer-health")
    if "ENTRYPOINT" not in words and "CMD" not in words:
        bad(stages[-1]["line"], "the runtime stage has neither ENTRYPOINT nor CMD")
    if len(stages) < 2:
        bad(1, "expected a multi-stage build (build stage, runtime stage)")
    return problems


def lint_compose(path):
    try:
        import yaml
    except ImportError:
        print("SKIP compose structure: no PyYAML for this python3")
        return []
    problems = []
    root = os.path.dirname(os.path.abspath(path))
    doc = yaml.safe_load(open(path, encoding="utf-8"))

    def bad(message):
        problems.append(f"{path}: {message}")

    services = (doc or {}).get("services") or {}
    server = services.get("indexer")
    if not server:
        bad("no 'indexer' service")
        return problems
    build = server.get("build") or {}
    dockerfile = os.path.join(root, build.get("context", "."), build.get("dockerfile", "Dockerfile"))
    if not os.path.isfile(dockerfile):
        bad(f"indexer.build points at {dockerfile}, which does not exist")
    devices = (((server.get("deploy") or {}).get("resources") or {}).get("reservations")
               or {}).get("devices") or []
    if not any(d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])
               for d in devices):
        bad("indexer: no nvidia GPU reservation (deploy.resources.reservations.devices)")
    if server.get("ipc") != "host" and not server.get("shm_size"):
        bad("indexer: NCCL needs ipc: host or a large shm_size")
    env = server.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    if str(env.get("NCCL_NVLS_ENABLE")) != "0":
        bad("indexer: NCCL_NVLS_ENABLE must be \"0\"")
    memlock = (server.get("ulimits") or {}).get("memlock")
    if memlock is None:
        bad("indexer: no memlock ulimit")
    test = (server.get("healthcheck") or {}).get("test") or []
    if "decode-indexer-health" not in (test if isinstance(test, list) else [test]) and \
            "decode-indexer-health" not in str(test):
        bad("indexer: the healthcheck does not run decode-indexer-health")
    grace = str(server.get("stop_grace_period", ""))
    match = re.fullmatch(r"(\d+)s", grace)
    command = " ".join(server.get("command") or [])
    drain = re.search(r"--drain-seconds=\$\{\w+:-(\d+)\}", command)
    drain_grace = re.search(r"--drain-grace=\$\{\w+:-(\d+)\}", command)
    total = (int(drain.group(1)) if drain else 0) + (int(drain_grace.group(1)) if drain_grace else 0)
    if not match:
        bad("indexer: stop_grace_period should be given in seconds")
    elif int(match.group(1)) <= total:
        bad("indexer: stop_grace_period must outlast --drain-grace + --drain-seconds")
    # The entrypoint must not add flags the command may also give (a repeated
    # --metrics-listen made the server refuse to start and the container crash-loop).
    entry = os.path.join(root, "entrypoint.sh")
    if os.path.isfile(entry) and re.search(r"set -- .*--", open(entry, encoding="utf-8").read()):
        bad("entrypoint.sh: adds flags to the server's command line; let the server read its "
            "environment instead (DI_METRICS_LISTEN)")
    for env_file in server.get("env_file") or []:
        if not os.path.isfile(os.path.join(root, env_file)):
            bad(f"indexer: env_file {env_file} does not exist")
    for volume in server.get("volumes") or []:
        source = volume.split(":")[0]
        if source.startswith(".") and not os.path.exists(os.path.join(root, source)):
            bad(f"indexer: volume source {source} does not exist")
    profile = re.search(r"--profile=\$\{\w+:-([^}]+)\}", " ".join(server.get("command") or []))
    if profile and profile.group(1).startswith("/etc/decode-indexer/profiles/"):
        local = os.path.join(root, "profiles", os.path.basename(profile.group(1)))
        if not os.path.isfile(local):
            bad(f"indexer: default profile {profile.group(1)} is not in deploy/profiles")
    load = services.get("load")
    if not load:
        bad("no 'load' service")
    else:
        if "load" not in (load.get("profiles") or []):
            bad("load: should only run under the compose profile 'load'")
        entry = load.get("entrypoint") or []
        if "decode-indexer-load" not in (entry if isinstance(entry, list) else [entry]):
            bad("load: entrypoint should be decode-indexer-load")
        depends = (load.get("depends_on") or {}).get("indexer") or {}
        if depends.get("condition") != "service_healthy":
            bad("load: should wait for the indexer to be healthy")
    return problems


def _seconds(flag, args):
    for a in args:
        m = re.fullmatch(rf"{flag}=(\d+(?:\.\d+)?)", a)
        if m:
            return float(m.group(1))
    return 0.0


def lint_k8s(directory):
    """The Kubernetes manifests' structure: what kubectl's offline dry run cannot check."""
    try:
        import yaml
    except ImportError:
        print("SKIP k8s structure: no PyYAML for this python3")
        return []
    problems = []
    docs = []
    for name in sorted(os.listdir(directory)):
        if name.endswith((".yaml", ".yml")):
            path = os.path.join(directory, name)
            docs += [(path, d) for d in yaml.safe_load_all(open(path, encoding="utf-8")) if d]
    workloads = [(p, d) for p, d in docs if d.get("kind") in ("StatefulSet", "Deployment")]
    services = [d for _, d in docs if d.get("kind") == "Service"]
    if not workloads:
        return [f"{directory}: no StatefulSet or Deployment"]
    for path, w in workloads:
        def bad(message):
            problems.append(f"{path}: {w['kind']} {w['metadata']['name']}: {message}")
        pod = w["spec"]["template"]
        labels = pod["metadata"].get("labels") or {}
        if w["spec"]["selector"].get("matchLabels") != {k: labels.get(k) for k in
                                                         w["spec"]["selector"]["matchLabels"]}:
            bad("the selector does not match the pod template's labels")
        containers = pod["spec"]["containers"]
        c = next((c for c in containers if "decode-indexer" in c.get("image", "")), None)
        if c is None:
            bad("no container runs the decode-indexer image")
            continue
        args = c.get("args") or []
        ready = (c.get("readinessProbe") or {}).get("grpc") or {}
        if not ready:
            bad("the readiness probe should be a gRPC (grpc.health.v1) probe")
        elif ready.get("service") != "decode_indexer.v1.DecodeIndexer":
            bad("the readiness probe should ask for service decode_indexer.v1.DecodeIndexer")
        port = str(ready.get("port", ""))
        if port and f"--listen=0.0.0.0:{port}" not in args:
            bad(f"the readiness probe's port {port} is not the server's --listen port")
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        drain = _seconds("--drain-grace", args) + _seconds("--drain-timeout", args)
        if grace <= drain:
            bad(f"terminationGracePeriodSeconds {grace} must outlast --drain-grace + "
                f"--drain-timeout ({drain:g} s)")
        if _seconds("--drain-grace", args) <= 0:
            bad("--drain-grace should be > 0 so that readiness fails before the server stops")
        period = (c.get("readinessProbe") or {}).get("periodSeconds", 10) * \
            (c.get("readinessProbe") or {}).get("failureThreshold", 3)
        if _seconds("--drain-grace", args) < period:
            bad(f"--drain-grace should cover the readiness probe's detection time ({period} s)")
        gpus = ((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
        if not gpus:
            bad("no nvidia.com/gpu limit")
        if not any(s["spec"].get("selector") == {k: labels.get(k) for k in s["spec"]["selector"]}
                   and s["spec"].get("clusterIP") == "None" for s in services):
            bad("no headless Service selects the pods (a hashing gateway needs every pod)")
    return problems


def main():
    linters = {"dockerfile": lint_dockerfile, "compose": lint_compose, "k8s": lint_k8s}
    if len(sys.argv) != 3 or sys.argv[1] not in linters:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    problems = linters[sys.argv[1]](sys.argv[2])
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
