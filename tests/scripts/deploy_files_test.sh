#!/usr/bin/env bash
# Tests the files in deploy/ against the real binaries:
#   k8s    parses (python3-yaml), has the ConfigMap / headless Service /
#          StatefulSet (with checkpoint volumes) / Job, its ember.toml passes
#          `ember-server --check-config` (also with the per-pod server_index),
#          and the flags its commands use exist in the binaries' --help;
#   slurm  bash -n, shellcheck (when installed), its flags exist, and its
#          per-server --set overrides pass --check-config;
#   systemd ExecStart's flags exist; reserve-hugepages.sh parses (sh -n) and
#          the sysctl drop-in is "key = value";
#   Dockerfile: structure only (no container engine here, and hadolint is not
#          in Debian 12): known instructions, debian:12 build stage and
#          debian:12-slim runtime stage, apt-get with --no-install-recommends
#          and the list cleanup, a non-root USER, a HEALTHCHECK on /metrics,
#          exec-form ENTRYPOINT, every RUN parses with sh -n, and each binary
#          it copies is a target of the CMake directory it copies it from.
#   deploy_files_test.sh EMBER_SERVER_BIN [FMNIST_WORKER_BIN or ""]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
server=$1
worker=${2:-}
py=/usr/bin/python3
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
"$server" --help >"$tmp/server.help"
has_flag() { grep -Eq -- "(^|[ ,])$2([ ,=]|$)" "$1" || fail "flag $2 is not in $(basename "$1" .help)'s --help"; }

# A token file, standing in for the Secret's and the job's.
echo "from-the-secret" >"$tmp/token"

# --- k8s ---------------------------------------------------------------------
"$py" - "$root/deploy/k8s/ember.yaml" "$tmp" <<'PY' || fail "deploy/k8s/ember.yaml"
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = {d["kind"]: d for d in docs}
for k in ("ConfigMap", "Service", "StatefulSet", "Job"):
    assert k in kinds, f"no {k}"
svc, sts, job, cm = kinds["Service"], kinds["StatefulSet"], kinds["Job"], kinds["ConfigMap"]
assert svc["spec"].get("clusterIP") == "None", "the Service must be headless (clusterIP: None)"
assert sts["spec"]["serviceName"] == svc["metadata"]["name"], "StatefulSet.serviceName != Service"
assert sts["spec"]["volumeClaimTemplates"], "no checkpoint volume"
sel = sts["spec"]["selector"]["matchLabels"]
assert all(sts["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
assert svc["spec"]["selector"] == sel, "Service selector does not match the StatefulSet"
mounts = {m["mountPath"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
assert "/var/lib/ember" in mounts and "/etc/ember" in mounts, mounts
open(sys.argv[2] + "/k8s.toml", "w").write(cm["data"]["ember.toml"])
cmd = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["args"])
open(sys.argv[2] + "/k8s-server.cmd", "w").write(cmd)
open(sys.argv[2] + "/k8s-worker.cmd", "w").write(" ".join(job["spec"]["template"]["spec"]["containers"][0]["args"]))
assert job["spec"]["completionMode"] == "Indexed", "workers take their rank from the completion index"
replicas = sts["spec"]["replicas"]
servers = [l for l in cm["data"]["ember.toml"].splitlines() if l.startswith("servers")]
# The servers' hugepages hold the page pool: prealloc_pages (set on the
# servers' command line, not in the ConfigMap the workers share) x 2 MiB.
import re
pages = re.search(r"--set communication\.prealloc_pages=(\d+)", cmd)
assert pages, "the servers' command does not set prealloc_pages (the hugepages request is sized from it)"
assert not re.search(r"^prealloc_pages", cm["data"]["ember.toml"], re.M), \
    "prealloc_pages in the ConfigMap would size the workers' pools too"
res = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
for side in ("requests", "limits"):
    assert res[side]["hugepages-2Mi"] == f"{int(pages.group(1)) * 2}Mi", \
        f"hugepages-2Mi {side} {res[side]['hugepages-2Mi']} != prealloc_pages x 2 MiB"
assert "--rejoin" in " ".join(job["spec"]["template"]["spec"]["containers"][0]["args"]), \
    "restarted worker pods (restartPolicy OnFailure) need --rejoin"
assert servers and servers[0].count(":7070") == replicas, "cluster.servers does not list every replica"
# The token: a file of the Secret mounted in every pod, which the ConfigMap's
# auth_token_file names; never on a command line or in the environment.
token_file = re.search(r'^auth_token_file = "(.+)"$', cm["data"]["ember.toml"], re.M)
assert token_file, "the ConfigMap's [communication] has no auth_token_file"
for name, spec in (("server", sts["spec"]["template"]["spec"]), ("worker", job["spec"]["template"]["spec"])):
    c = spec["containers"][0]
    assert "auth_token" not in " ".join(c["args"]), f"the {name} command line carries the token"
    assert not c.get("env"), f"the {name} environment carries the token"
    secrets = {v["name"] for v in spec["volumes"] if "secret" in v}
    mounted = [m for m in c["volumeMounts"] if m["name"] in secrets
               and token_file.group(1).startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounted, f"the {name} pod does not mount a Secret at {token_file.group(1)}"
    # The Secret's files are mode 0400 owned by fsGroup: the pod must run as
    # that non-root user to read the token (and no other user may).
    sc = spec.get("securityContext") or {}
    assert sc.get("runAsNonRoot") and sc.get("runAsUser") and sc.get("fsGroup") == sc.get("runAsUser"), \
        f"the {name} pod must run as the image's non-root user with fsGroup = runAsUser: {sc}"
# Checked below with this test's token file in the Secret's place.
open(sys.argv[2] + "/k8s.toml", "w").write(
    cm["data"]["ember.toml"].replace(token_file.group(1), sys.argv[2] + "/token"))
PY
"$server" --config "$tmp/k8s.toml" --check-config >/dev/null \
  || fail "k8s ConfigMap ember.toml is not valid"
"$server" --config "$tmp/k8s.toml" --set server.server_index=1 --check-config >/dev/null \
  || fail "k8s: server_index 1 refused"
if "$server" --config "$tmp/k8s.toml" --set communication.auth_token_file= --check-config >/dev/null 2>&1; then
  fail "k8s: a 0.0.0.0 listen address without a token passed --check-config"
fi
for f in $(grep -o -- ' --[a-z][a-z-]*' "$tmp/k8s-server.cmd"); do has_flag "$tmp/server.help" "$f"; done
grep -q -- '--set "server.server_index=${HOSTNAME##\*-}"' "$tmp/k8s-server.cmd" \
  || fail "k8s server command does not set server_index from the pod ordinal"

if [[ -n $worker ]]; then
  "$worker" --help >"$tmp/worker.help"
  for f in $(grep -o -- ' --[a-z][a-z-]*' "$tmp/k8s-worker.cmd"); do has_flag "$tmp/worker.help" "$f"; done
  for f in $(grep -o -- "--[a-z][a-z-]*" <(grep -A3 fmnist-worker "$root/deploy/slurm/ember.sbatch" | grep -v '^#')); do
    has_flag "$tmp/worker.help" "$f"
  done
else
  echo "note: fmnist-worker not built here: worker flags not checked"
fi

# --- slurm -------------------------------------------------------------------
bash -n "$root/deploy/slurm/ember.sbatch" || fail "ember.sbatch does not parse"
if command -v shellcheck >/dev/null; then
  shellcheck -S warning "$root/deploy/slurm/ember.sbatch" "$root/scripts/launch_workers.sh" \
    "$root/scripts/profile/"*.sh "$root/deploy/systemd/reserve-hugepages.sh" || fail "shellcheck"
else
  echo "note: shellcheck not installed"
fi
for f in $(grep -A3 'server/ember-server' "$root/deploy/slurm/ember.sbatch" | grep -v '^#' | grep -o -- '--[a-z][a-z-]*' | sort -u); do
  has_flag "$tmp/server.help" "$f"
done
# The configs its usage names: the default and the multi-server example,
# which writes an auth_token of its own (the sbatch clears it). Its
# checkpoint_dir (/var/lib/ember) is moved here: this test may run unprivileged.
for config in config/ember.toml config/examples/multi-server.toml; do
  (cd "$root" && "$server" --config "$config" --set "cluster.servers=n1:7070,n2:7070" \
    --set cluster.num_workers=8 --set server.server_index=1 --set "communication.auth_token=" \
    --set "communication.auth_token_file=$tmp/token" --set "server.checkpoint_dir=$tmp/ckpt" --listen 0.0.0.0:7070 --check-config >/dev/null) \
    || fail "slurm's overrides are refused by --check-config with $config"
done

# --- systemd -----------------------------------------------------------------
unit="$root/deploy/systemd/ember-server.service"
exec_start=$(grep '^ExecStart=' "$unit" | cut -d= -f2-)
for f in $(grep -o -- '--[a-z][a-z-]*' <<<"$exec_start"); do has_flag "$tmp/server.help" "$f"; done
sh -n "$root/deploy/systemd/reserve-hugepages.sh" || fail "reserve-hugepages.sh does not parse"
grep -Eq '^vm\.nr_hugepages = [0-9]+$' "$root/deploy/systemd/99-ember-hugepages.conf" \
  || fail "99-ember-hugepages.conf is not a sysctl drop-in"

# --- Dockerfile ----------------------------------------------------------------
"$py" - "$root" <<'PY' || fail "deploy/container/Dockerfile"
import json, os, re, subprocess, sys
root = sys.argv[1]
text = open(f"{root}/deploy/container/Dockerfile").read()
# Join continuation lines, drop comments.
logical, cur = [], ""
for line in text.splitlines():
    if not cur and (not line.strip() or line.lstrip().startswith("#")):
        continue
    if line.rstrip().endswith("\\"):
        cur += line.rstrip()[:-1] + " "
        continue
    logical.append(cur + line)
    cur = ""
assert not cur, "dangling line continuation"
known = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
         "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
instr = [(l.split(None, 1)[0].upper(), l.split(None, 1)[1] if len(l.split(None, 1)) > 1 else "")
         for l in logical]
bad = [i for i, _ in instr if i not in known]
assert not bad, f"unknown instructions {bad}"
froms = [a for i, a in instr if i == "FROM"]
assert len(froms) >= 2, "not multi-stage"
assert re.fullmatch(r"debian:12 AS build", froms[0]), froms[0]
assert re.fullmatch(r"debian:12-slim AS runtime", froms[-1]), froms[-1]
last = max(k for k, (i, _) in enumerate(instr) if i == "FROM")
runtime = instr[last:]
users = [a for i, a in runtime if i == "USER"]
assert users and users[-1].split(":")[0] not in ("root", "0"), "runtime runs as root"
hc = [a for i, a in runtime if i == "HEALTHCHECK"]
assert hc and "/metrics" in hc[0], "no HEALTHCHECK on the metrics endpoint"
ep = [a for i, a in runtime if i == "ENTRYPOINT"]
assert ep and isinstance(json.loads(ep[0]), list), "ENTRYPOINT must be exec form (JSON)"
assert not any(i == "ADD" and "://" in a for i, a in instr), "ADD of a URL"
for i, a in instr:
    if i != "RUN":
        continue
    if "apt-get install" in a:
        assert "--no-install-recommends" in a, "apt-get install without --no-install-recommends"
        assert "rm -rf /var/lib/apt/lists" in a, "apt lists not removed in the same RUN"
    r = subprocess.run(["sh", "-n", "-c", a], capture_output=True, text=True)
    assert r.returncode == 0, f"RUN does not parse: {r.stderr}"
# COPY --from=build paths: build/release/<dir>/<target> must be a target of <dir>/CMakeLists.txt.
copies = [a for i, a in instr if i == "COPY" and a.startswith("--from=build")]
assert copies, "runtime copies nothing from the build stage"
for a in copies:
    src = a.split()[1]
    m = re.fullmatch(r"/src/build/release/(.+)/([^/]+)", src)
    assert m, f"unexpected COPY source {src}"
    cml = f"{root}/{m.group(1)}/CMakeLists.txt"
    assert os.path.exists(cml), f"{src}: no {m.group(1)}/CMakeLists.txt"
    assert re.search(r"ember_add_executable\(\s*" + re.escape(m.group(2)) + r"\b", open(cml).read()), \
        f"{src}: {m.group(2)} is not a target in {m.group(1)}/CMakeLists.txt"
    build_line = next(b for j, b in instr if j == "RUN" and "--target" in b)
    assert m.group(2) in build_line, f"{m.group(2)} is copied but not built"
PY
# The server command in the Dockerfile's header: its arguments after the
# image name, with the mounted file being config/ember.toml, pass
# --check-config (a 0.0.0.0 listen address needs the token it sets).
"$py" - "$root" "$tmp/docker-server.args" "$tmp/token" <<'PY' || fail "deploy/container/Dockerfile: header"
import shlex, sys
root, out = sys.argv[1], sys.argv[2]
lines = open(f"{root}/deploy/container/Dockerfile").read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith("#   docker run --rm -p"))
cmd = ""
for l in lines[start:]:
    part = l[1:].strip()
    if part.endswith("\\"):
        cmd += part[:-1] + " "
        continue
    cmd += part
    break
words = shlex.split(cmd.replace("$PWD", "/here"))
args = words[words.index("ember") + 1:]
assert args[:2] == ["--config", "/etc/ember/ember.toml"], args
args[1] = f"{root}/config/ember.toml"
# The token file it mounts, at the path auth_token_file names: this test's.
mounted = [w for w in words if w.endswith(":/run/secrets/ember-token:ro")]
assert mounted, "the docker run command does not mount the token file"
args = [a.replace("/run/secrets/ember-token", sys.argv[3]) for a in args]
open(out, "w").write("\n".join(args) + "\n")
PY
mapfile -t docker_args <"$tmp/docker-server.args"
"$server" "${docker_args[@]}" --check-config >/dev/null \
  || fail "the Dockerfile's docker run arguments do not pass --check-config"
grep -qx 'build/' "$root/.dockerignore" || fail ".dockerignore does not keep build/ out of the docker context"

echo "deploy_files_test: ok"
