"""The shipped cluster configs, as the tools that run them see them: ray_cluster.yaml against Ray's
own schema, its `docker run` as the launcher builds it, and its start commands run through the
launcher's own shell wrapper against a local head and worker; the KubeRay RayJob against the
field names KubeRay documents and the rules it relies on; the job runtime env.

What no test here can reach (no cloud, no Kubernetes): the AMI id, EFA and the placement group
are checked statically, and so is the KubeRay manifest (README: "On a GPU cluster")."""

import ast
import copy
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import ray
import yaml

import kuberay_rayjob_fields as kuberay_fields
from paratune.sweep.space import load_space
from procs import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPU_TYPE = "gpu_8x_h100"


def _cluster_config() -> dict:
    return yaml.safe_load((REPO / "ray_cluster.yaml").read_text())


def _validate(config: dict) -> dict:
    """What `ray up` does before it touches a cloud: fill the provider's defaults, then validate
    against ray/autoscaler/ray-schema.json and the launcher's own rules."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def test_ray_cluster_yaml_validates_against_rays_schema():
    config = _cluster_config()
    prepared = _validate(config)
    # Same Ray as the driver; a CPU head that never hosts a GPU worker; GPU worker types.
    assert ray.__version__ in config["docker"]["image"] and ray.__version__ in config["docker"]["head_image"]
    head = prepared["head_node_type"]
    assert prepared["available_node_types"][head]["max_workers"] == 0
    assert any("gpu" in name for name in prepared["available_node_types"] if name != head)
    # A GPU node is up when a sweep starts (its cost model reads the cluster's GPUs then).
    assert prepared["available_node_types"][GPU_TYPE]["min_workers"] >= 1
    # Safe defaults: the dashboard/job server and MLflow listen on 127.0.0.1 only; token auth.
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    assert "--host 127.0.0.1" in head_start and "RAY_AUTH_MODE=token" in head_start
    assert all("RAY_AUTH_MODE=token" in c for c in config["worker_start_ray_commands"] if "ray start" in c)
    assert any("constraints.txt" in c and "-e ~/paratune\"[all]\"" in c for c in config["setup_commands"])  # every extra


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["available_node_types"]["head"].update(typo_field=1), "typo_field"),
    (lambda c: c.update(head_node_type="nope"), "head_node_type"),
    (lambda c: c["available_node_types"][GPU_TYPE].update(min_workers="two"), "two"),
])
def test_the_schema_check_catches_a_broken_config(mutate, message):
    config = _cluster_config()
    mutate(config)
    with pytest.raises(Exception, match=message):
        _validate(config)


# --- the nodes: AMI, EFA (static: no cloud here) -----------------------------------------------

def _rays_fallback_amis() -> set[str]:
    """DEFAULT_AMI of the installed launcher (ray/autoscaler/_private/aws/config.py), read from its
    source: the module itself needs boto3. `ray up` uses these when a node has no ImageId."""
    import ray.autoscaler._private as launcher

    source = (Path(launcher.__file__).parent / "aws" / "config.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DEFAULT_AMI" for t in node.targets):
            return set(ast.literal_eval(node.value).values())
    raise AssertionError("DEFAULT_AMI not found in the launcher's aws/config.py")


def test_every_node_names_its_ami_and_gpu_nodes_get_efa():
    text = (REPO / "ray_cluster.yaml").read_text()
    config = _cluster_config()
    fallback = _rays_fallback_amis()
    assert fallback
    for name, node_type in config["available_node_types"].items():
        ami = node_type["node_config"].get("ImageId", "")
        # No ImageId (or "latest_dlami") and the launcher picks its old Ubuntu 18.04 DLAMI.
        assert ami and ami.lower() != "latest_dlami" and ami not in fallback, name
    assert "aws ssm get-parameter" in text
    assert "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id" in text

    gpu = config["available_node_types"][GPU_TYPE]["node_config"]
    assert gpu["InstanceType"] == "p5.48xlarge"
    interfaces = gpu["NetworkInterfaces"]
    # P5: one EFA interface on each of its 32 network cards, card 0 at device index 0, the others at 1.
    assert sorted(i["NetworkCardIndex"] for i in interfaces) == list(range(32))
    assert all(i["InterfaceType"] in ("efa", "efa-only") for i in interfaces)
    assert all(i["DeviceIndex"] == (0 if i["NetworkCardIndex"] == 0 else 1) for i in interfaces)
    assert next(i for i in interfaces if i["NetworkCardIndex"] == 0)["InterfaceType"] == "efa"
    # The launcher's rule with NetworkInterfaces (aws/config.py,
    # _configure_subnets_and_groups_from_network_interfaces): subnet and groups on every interface,
    # none on the node config.
    assert all(i.get("SubnetId") and i.get("Groups") for i in interfaces)
    assert not {"SubnetId", "SubnetIds", "SecurityGroupIds"} & set(gpu)
    assert len({i["SubnetId"] for i in interfaces}) == 1  # one subnet: one zone, one placement group
    assert gpu["Placement"]["GroupName"]
    head = config["available_node_types"][config["head_node_type"]]["node_config"]
    assert head["SecurityGroupIds"] == interfaces[0]["Groups"]  # head and workers talk freely


# --- `docker run`, as the launcher builds it ---------------------------------------------------

class _LauncherHost:
    """Stands in for the node behind SSH while the launcher's DockerCommandRunner.run_init prepares
    a node: answers its probes (docker present, container not running, image HOME, NVIDIA runtime,
    /proc/meminfo) and records every command."""

    ssh_user = "ubuntu"
    cluster_name = "paratune"
    ANSWERS = {
        "command -v docker": b"/usr/bin/docker",
        "docker inspect -f '{{.State.Running}}'": b"",
        "docker inspect -f '{{json .Config.Env}}'": b'["PATH=/usr/bin:/bin", "HOME=/home/ray"]',
        "docker info -f '{{.Runtimes}}'": b"map[io.containerd.runc.v2:{} nvidia:{nvidia-container-runtime} runc:{}]",
        "cat /proc/meminfo": b"MemTotal: 2097152000 kB\nMemAvailable: 2000000000 kB\n",
    }

    def __init__(self):
        self.commands: list[str] = []

    def run(self, cmd, with_output=False, **_):
        self.commands.append(cmd)
        for prefix, answer in self.ANSWERS.items():
            if cmd.startswith(prefix):
                return answer
        return b"" if with_output else 0


def _launcher_docker_run(config: dict, node_type: str) -> list[str]:
    """The `docker run` argv the launcher runs on a node of node_type: the node type's docker
    section merged over the global one (StandardAutoscaler._get_node_specific_docker_config), then
    DockerCommandRunner.run_init, which adds shm size, the NVIDIA runtime and docker_start_cmds'
    own options (--net=host)."""
    from ray.autoscaler._private.command_runner import DockerCommandRunner

    as_head = node_type == config["head_node_type"]
    docker = copy.deepcopy(config["docker"])
    if not as_head:
        docker.update(config["available_node_types"][node_type].get("docker", {}))
    runner = DockerCommandRunner(docker, log_prefix="", node_id=node_type, provider=None,
                                 auth_config=config["auth"], cluster_name=config["cluster_name"],
                                 process_runner=None, use_internal_ip=True)
    host = runner.ssh_command_runner = _LauncherHost()
    runner.run_init(as_head=as_head, file_mounts=config["file_mounts"], sync_run_yet=True)
    runs = [shlex.split(c) for c in host.commands if c.startswith("docker run ")]
    assert len(runs) == 1, host.commands
    return runs[0]


DOCKER_FLAGS = {"--rm", "-d", "--detach", "-it", "-i", "-t", "--interactive", "--tty", "--init", "--privileged"}
SINGLE_VALUED = {"--network", "--ipc", "--pid", "--shm-size", "--runtime", "--gpus", "--name", "--user"}


def _docker_options(argv: list[str]) -> list[tuple[str, str]]:
    """(option, value) pairs of a `docker run` argv up to the image; --net is --network."""
    assert argv[:2] == ["docker", "run"], argv
    options, i = [], 2
    while i < len(argv) and argv[i].startswith("-"):
        key, eq, value = argv[i].partition("=")
        if not eq and key not in DOCKER_FLAGS:
            i += 1
            value = argv[i]
        options.append(({"--net": "--network"}.get(key, key), value))
        i += 1
    return options


def _docker_run_problems(argv: list[str], gpu: bool) -> list[str]:
    options = _docker_options(argv)
    problems = []
    for key in SINGLE_VALUED:
        given = [value for k, value in options if k == key]
        if len(given) > 1:
            problems.append(f"{key} given {len(given)} times: {given}")
    if [v for k, v in options if k == "--network"] != ["host"]:
        problems.append("not exactly one --net=host")
    if gpu:
        wanted = {("--gpus", "all"): "--gpus all", ("--ipc", "host"): "--ipc=host",
                  ("--cap-add", "IPC_LOCK"): "--cap-add=IPC_LOCK", ("--ulimit", "memlock=-1:-1"): "memlock"}
        problems += [f"no {what}" for option, what in wanted.items() if option not in options]
        if not any(k == "--device" and v.startswith("/dev/infiniband") for k, v in options):
            problems.append("no --device=/dev/infiniband")
    elif any(k == "--gpus" for k, _ in options):
        problems.append("--gpus on a CPU node")
    return problems


def test_launchers_docker_run_has_no_conflicting_options_and_gpu_workers_get_gpus_and_efa():
    config = _cluster_config()
    worker = _launcher_docker_run(config, GPU_TYPE)
    assert worker[-2:] == [config["docker"]["image"], "bash"]
    assert _docker_run_problems(worker, gpu=True) == []
    head = _launcher_docker_run(config, config["head_node_type"])
    assert head[-2:] == [config["docker"]["head_image"], "bash"]
    assert _docker_run_problems(head, gpu=False) == []


def _worker_options(config):
    return config["available_node_types"][GPU_TYPE]["docker"]["worker_run_options"]


@pytest.mark.parametrize("mutate, problem", [
    (lambda c: _worker_options(c).append("--network=host"), "--network given 2 times"),  # the old bug
    (lambda c: _worker_options(c).append("--ipc=private"), "--ipc given 2 times"),
    (lambda c: _worker_options(c).remove("--gpus all"), "no --gpus all"),
    (lambda c: _worker_options(c).remove("--device=/dev/infiniband"), "no --device=/dev/infiniband"),
])
def test_the_docker_run_check_catches_conflicts_and_missing_gpu_options(mutate, problem):
    config = _cluster_config()
    mutate(config)
    problems = _docker_run_problems(_launcher_docker_run(config, GPU_TYPE), gpu=True)
    assert any(problem in p for p in problems), problems


# --- start commands, through the launcher's own wrapper, on local "nodes" ----------------------

ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REAPER = "import os, time\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        time.sleep(0.2)"


def _namespaces_work() -> bool:
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        return False
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "true"],
                          capture_output=True)
    return done.returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_work(), reason="needs user + PID namespaces (unshare, nsenter)")


class _Node:
    """One cluster node as the launcher sees it: a container with its own process table (a PID
    namespace, so `ray stop` and `pkill` see this node's processes only, as in the node's
    container, and never the other Ray clusters or MLflow servers on this machine), sharing the
    host's network (docker run --net=host) and with its own HOME. Commands reach it the way they
    reach the container: the launcher's DockerCommandRunner.run builds the `docker exec -it
    paratune /bin/bash -c ...` line, and the part after `docker exec -it paratune` runs here with
    nsenter. Killing the namespace's init ends every process the node started."""

    def __init__(self, root: Path, name: str, bashrc: str):
        from ray.autoscaler._private.command_runner import DockerCommandRunner

        self.home = root / name
        (self.home / ".ray").mkdir(parents=True)
        (self.home / ".bashrc").write_text(bashrc)  # the image's environment; the wrapper sources it
        self.init = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", sys.executable, "-c", REAPER],
            start_new_session=True)
        try:
            children = Path(f"/proc/{self.init.pid}/task/{self.init.pid}/children")
            deadline = time.time() + 10
            while not children.read_text().split():
                assert time.time() < deadline, "the node's namespace did not start"
                time.sleep(0.02)
            self.pid = int(children.read_text().split()[0])  # its init (pid 1 inside)
        except BaseException:
            self.kill()
            raise
        self.runner = DockerCommandRunner({"container_name": "paratune"}, log_prefix="", node_id=name, provider=None,
                                          auth_config={"ssh_user": "ubuntu"}, cluster_name="paratune",
                                          process_runner=None, use_internal_ip=True)
        self.runner.ssh_command_runner = self
        self.ssh_user, self.cluster_name = "ubuntu", "paratune"
        self.done: list[subprocess.CompletedProcess] = []
        self.timings: list[str] = []

    def run(self, cmd, timeout=120, with_output=False, **_):
        """What SSHCommandRunner.run would send to the host: here `docker exec` is nsenter."""
        argv = shlex.split(cmd)
        if argv == ["docker", "exec", "paratune", "printenv", "HOME"]:  # the launcher expanding ~/
            return str(self.home).encode()
        assert argv[:6] == ["docker", "exec", "-it", "paratune", "/bin/bash", "-c"] and len(argv) == 7, cmd
        done = self.enter(argv[4:], timeout=timeout)
        self.done.append(done)
        return done.stdout.encode() if with_output else done.returncode

    def enter(self, argv, timeout=120) -> subprocess.CompletedProcess:
        env = {"HOME": str(self.home), "PATH": ROOT_PATH, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        return subprocess.run(["nsenter", "-t", str(self.pid), "-U", "--preserve-credentials", "-p", "-m", "--", *argv],
                              env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def launch(self, cmd: str, env_vars: dict | None = None) -> subprocess.CompletedProcess:
        """One start command, as NodeUpdater runs it: cmd_runner.run(cmd, environment_variables=...,
        run_env="auto"); returns what the command did (the launcher fails `ray up` on rc != 0)."""
        started = time.time()
        self.runner.run(cmd, environment_variables=env_vars or {}, run_env="auto")
        self.timings.append(f"{self.home.name}: {cmd[:40]!r} {time.time() - started:.1f} s")
        return self.done[-1]

    def processes(self) -> list[str]:
        """This node's live processes (zombies are gone), as `ps -eo stat,args` lines."""
        lines = self.enter(["ps", "-eo", "stat,args"]).stdout.splitlines()[1:]
        return [line.split(None, 1)[1] for line in lines if not line.lstrip().startswith("Z")]

    def kill(self):
        try:
            os.killpg(self.init.pid, 9)
        except ProcessLookupError:
            pass
        self.init.wait()


def _substitute(commands: list[str], subs: list[tuple[str, str]]) -> list[str]:
    """Replace whole whitespace-separated tokens (old -> new; new "" drops the token); each old
    token must occur exactly once, and a token diff shows that nothing else changed."""
    joined = "\n".join(commands)
    for old, _ in subs:
        assert len(re.findall(rf"(?<!\S){re.escape(old)}(?!\S)", joined)) == 1, (old, commands)
    out = []
    for command in commands:
        for old, new in subs:
            command = re.sub(rf"(?<!\S){re.escape(old)}(?!\S)", new, command)
        out.append(command)
    before, after = joined.split(), "\n".join(out).split()
    dropped = [(token, "") for token in before if (token, "") in subs]
    kept = [token for token in before if (token, "") not in subs]
    assert len(kept) == len(after), (before, after)
    changed = [(b, a) for b, a in zip(kept, after) if b != a]
    assert sorted(changed + dropped) == sorted(subs), changed + dropped
    return out


def _mlflow_line(config: dict) -> str:
    (line,) = [c for c in config["head_start_ray_commands"] if "paratune ui" in c]
    return line


OLD_MLFLOW_LINE = ('pkill -f "mlflow ui" || true; nohup paratune ui --tracking-uri '
                   'sqlite:///$HOME/paratune_runs/mlflow.db --host 127.0.0.1 --port 5000 > ~/paratune_runs/mlflow.log 2>&1 &')


@needs_namespaces
@pytest.mark.parametrize("which", ["ray_cluster.yaml", "the old line"])
def test_the_mlflow_restart_line_survives_the_launchers_wrapper(which, tmp_path):
    """The head's MLflow line, verbatim, through the launcher's wrapper (bash --login -c -i '...',
    whose command line holds the line's text) on a node where an MLflow server already runs (a
    re-run `ray up`): it must stop that server (`mlflow ui` and its uvicorn child) and nothing
    else, and survive to start the new one. `paratune` is a stub here that records its arguments
    (the real server is the next test's). The old line's pkill matched its own wrapper: killed,
    never reaching `paratune ui`."""
    line = _mlflow_line(_cluster_config()) if which == "ray_cluster.yaml" else OLD_MLFLOW_LINE
    stub = tmp_path / "bin" / "paratune"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "$@" > "$HOME/ui-args"\n')
    stub.chmod(0o755)
    node = _Node(tmp_path, "head", f'export PATH="{stub.parent}:$PATH"\n')
    try:
        assert node.launch("mkdir -p ~/paratune_runs").returncode == 0  # a setup command
        db = node.home / "paratune_runs" / "mlflow.db"
        old_server = {  # the command lines `paratune ui` leaves running (mlflow ui execs uvicorn)
            f"{BIN}/python3 {BIN}/mlflow ui --backend-store-uri sqlite:///{db} --host 127.0.0.1 --port 5000",
            f"{BIN}/python3 -m uvicorn --host 127.0.0.1 --port 5000 --workers 4 mlflow.server.fastapi_app:app",
        }
        bystander = f"sqlite3 {db} .tables --port 5000"  # mentions mlflow.db and the port: must stay
        spawn = " ".join(f"(exec -a {shlex.quote(c)} sleep 300) >/dev/null 2>&1 &" for c in [*old_server, bystander])
        assert node.enter(["/bin/bash", "-c", spawn]).returncode == 0
        deadline = time.time() + 10  # the backgrounded subshells exec their `sleep` a moment later (under load)
        while not {*old_server, bystander} <= {p.removesuffix(" 300") for p in node.processes()}:
            assert time.time() < deadline, node.processes()
            time.sleep(0.1)

        done = node.launch(line)
        ui_args = node.home / "ui-args"
        if which == "the old line":
            assert done.returncode != 0 and not ui_args.exists(), (done.returncode, done.stderr)
            return
        assert done.returncode == 0, done.stderr
        deadline = time.time() + 10
        while not ui_args.exists():
            assert time.time() < deadline, "paratune ui never ran"
            time.sleep(0.1)
        assert ui_args.read_text().split() == ["ui", "--tracking-uri", f"sqlite:///{db}", "--host", "127.0.0.1",
                                               "--port", "5000"]
        running = {p.removesuffix(" 300") for p in node.processes()}
        assert not old_server & running and bystander in running
    finally:
        node.kill()


# `e2e` (make test-e2e): `make test` keeps the start commands' own checks against Ray's schema and the
# launcher's docker run (above) and the MLflow restart line through the launcher's wrapper.
@pytest.mark.integration
@pytest.mark.e2e
@needs_namespaces
def test_start_commands_bring_up_a_head_a_worker_and_mlflow_through_the_launchers_wrapper():
    """head_start_ray_commands and worker_start_ray_commands, each line through the launcher's own
    wrapper (DockerCommandRunner.run + SSHCommandRunner's bash --login -c -i; RAY_HEAD_IP from
    with_head_node_ip) on two local nodes: a head, then a worker that joins it with token auth, and
    the MLflow server. Changed, and only these (checked token by token): ports that are taken on a
    shared machine (both nodes share this host's network, so their object-manager ports must
    differ) and --autoscaling-config (the launcher writes that file on a real head; here the head
    runs without the autoscaler). `ray stop` and `pkill` run as written: each node has its own
    process table."""
    from ray._common.usage import usage_constants
    from ray.autoscaler._private.util import with_head_node_ip

    config = _cluster_config()
    gcs, dashboard, mlflow_port, om_head, om_worker = (free_port() for _ in range(5))
    head_commands = _substitute(config["head_start_ray_commands"], [
        ("--port=6379", f"--port={gcs}"),
        ("--object-manager-port=8076", f"--object-manager-port={om_head}"),
        ("--autoscaling-config=~/ray_bootstrap_config.yaml", ""),
        ("--dashboard-port=8265", f"--dashboard-port={dashboard}"),
        ("5000", str(mlflow_port)),
    ])
    worker_commands = with_head_node_ip(_substitute(config["worker_start_ray_commands"], [
        ("--address=$RAY_HEAD_IP:6379", f"--address=$RAY_HEAD_IP:{gcs}"),
        ("--object-manager-port=8076", f"--object-manager-port={om_worker}"),
    ]), "127.0.0.1")
    first_start = next(i for i, c in enumerate(worker_commands) if "ray start" in c)
    setup = [c for c in config["setup_commands"] if c.startswith("mkdir")]
    assert setup == ["mkdir -p ~/paratune_runs"]

    root = Path(tempfile.mkdtemp(prefix="prc", dir="/tmp"))  # short: Ray's socket paths live under it
    # The nodes' environment (the image's, in a real container): Ray and paratune on PATH, Ray's
    # temp dir per node, one MLflow worker process (a 2-core CI machine).
    def bashrc(name):
        return f'export PATH="{BIN}:$PATH" RAY_TMPDIR="{root / name}-tmp" MLFLOW_WORKERS=1\n'
    nodes = []
    started = time.time()
    try:
        head = _Node(root, "head", bashrc("head"))
        nodes.append(head)
        worker = _Node(root, "worker", bashrc("worker"))
        nodes.append(worker)
        (root / "head-tmp").mkdir()
        (root / "worker-tmp").mkdir()
        token = secrets.token_hex(32)  # what `ray get-auth-token --generate` writes
        for node in nodes:  # file_mounts copies ~/.ray/auth_token to every node
            (node.home / ".ray" / "auth_token").write_text(token)
            assert node.launch(setup[0]).returncode == 0

        # The worker's commands before its `ray start` (ray stop) need no head: run them meanwhile.
        worker_prefix = threading.Thread(target=lambda: [worker.launch(c) for c in worker_commands[:first_start]])
        worker_prefix.start()
        for command in head_commands:
            done = head.launch(command, {usage_constants.USAGE_STATS_ENABLED_ENV_VAR: 0})
            assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        worker_prefix.join()
        for command in worker_commands[first_start:]:
            done = worker.launch(command)
            assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        assert all(d.returncode == 0 for d in worker.done)

        # The head sees both nodes (its dashboard, with the token); MLflow answers.
        nodes_alive = mlflow_up = nodes_seen = mlflow_seen = None
        deadline = time.time() + 120
        while time.time() < deadline and not (nodes_alive == 2 and mlflow_up):
            if nodes_alive != 2:
                request = urllib.request.Request(f"http://127.0.0.1:{dashboard}/nodes?view=summary",
                                                 headers={"Authorization": f"Bearer {token}"})
                try:
                    summary = json.load(urllib.request.urlopen(request, timeout=5))["data"]["summary"]
                    nodes_alive = sum(n["raylet"]["state"] == "ALIVE" for n in summary)
                    nodes_seen = time.time() - started
                except OSError:
                    pass
            if not mlflow_up:
                try:
                    mlflow_up = urllib.request.urlopen(f"http://127.0.0.1:{mlflow_port}/health", timeout=5).status == 200
                    mlflow_seen = time.time() - started
                except OSError:
                    pass
            time.sleep(0.5)
        log = (head.home / "paratune_runs" / "mlflow.log")
        assert nodes_alive == 2, nodes_alive
        assert mlflow_up, log.read_text()[-3000:] if log.exists() else "no mlflow.log"
        assert any(f"mlflow ui --backend-store-uri sqlite:///{head.home}/paratune_runs/mlflow.db" in p
                   for p in head.processes())
        print(f"head + worker + MLflow up in {time.time() - started:.1f} s:", *head.timings, *worker.timings,
              f"both nodes seen after {nodes_seen:.1f} s, MLflow healthy after {mlflow_seen:.1f} s", sep="\n  ")
    finally:
        for node in nodes:
            node.kill()
        shutil.rmtree(root, ignore_errors=True)


# --- KubeRay -----------------------------------------------------------------------------------

def _rayjob_documents() -> tuple[dict, dict]:
    documents = [d for d in yaml.safe_load_all((REPO / "kuberay" / "rayjob.yaml").read_text()) if d]
    (job,) = [d for d in documents if d["kind"] == "RayJob"]
    (claim,) = [d for d in documents if d["kind"] == "PersistentVolumeClaim"]
    return job, claim


def _ray_start_options() -> set[str]:
    from ray.scripts.scripts import start

    return {name.removeprefix("--") for p in start.params for name in p.opts if name.startswith("--")}


def _unknown_fields(value, tree, path: str, ray_start: set[str]) -> list[str]:
    """Every field of value that the tree (tests/kuberay_rayjob_fields.py) does not document."""
    if tree in (kuberay_fields.ANY, kuberay_fields.MAP):
        return []
    if tree == kuberay_fields.RAY_START:
        return [f"{path}.{key} (not a `ray start` option)" for key in value or {} if key not in ray_start]
    if isinstance(tree, list):
        assert isinstance(value, list), f"{path}: a list expected"
        return [u for i, item in enumerate(value) for u in _unknown_fields(item, tree[0], f"{path}[{i}]", ray_start)]
    assert isinstance(value, dict), f"{path}: an object expected"
    unknown = []
    for key, item in value.items():
        if key not in tree:
            unknown.append(f"{path}.{key}")
        else:
            unknown += _unknown_fields(item, tree[key], f"{path}.{key}", ray_start)
    return unknown


def _manifest_problems(documents) -> list[str]:
    ray_start = _ray_start_options()
    problems = []
    for doc in documents:
        tree = kuberay_fields.BY_KIND.get((doc.get("apiVersion"), doc.get("kind")))
        if tree is None:
            problems.append(f"unexpected document {doc.get('apiVersion')}/{doc.get('kind')}")
        else:
            problems += _unknown_fields(doc, tree, doc["kind"], ray_start)
    return problems


def test_kuberay_manifest_uses_only_fields_kuberay_documents():
    assert _manifest_problems(_rayjob_documents()) == []


@pytest.mark.parametrize("mutate, unknown", [
    (lambda job, claim: job["spec"].update(shutdownAfterJobFinish=True), "RayJob.spec.shutdownAfterJobFinish"),
    (lambda job, claim: job["spec"]["rayClusterSpec"].update(enableInTreeAutoscalling=True),
     "RayJob.spec.rayClusterSpec.enableInTreeAutoscalling"),
    (lambda job, claim: job["spec"]["rayClusterSpec"]["headGroupSpec"].update(serviceTyp="ClusterIP"),
     "RayJob.spec.rayClusterSpec.headGroupSpec.serviceTyp"),
    (lambda job, claim: job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].update(
        {"dashboard-hots": "0.0.0.0"}), "rayStartParams.dashboard-hots (not a `ray start` option)"),
    (lambda job, claim: job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["tolerations"][0]
     .update(efect="NoSchedule"), "template.spec.tolerations[0].efect"),
    (lambda job, claim: job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
     .update(volumeMount=[]), "template.spec.containers[0].volumeMount"),
    (lambda job, claim: job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].update(
        securityContex={"fsGroup": 100}), "headGroupSpec.template.spec.securityContex"),
    (lambda job, claim: claim["spec"].update(accesModes=["ReadWriteMany"]), "PersistentVolumeClaim.spec.accesModes"),
])
def test_a_misspelled_field_fails_the_manifest_check(mutate, unknown):
    job, claim = _rayjob_documents()
    mutate(job, claim)
    problems = _manifest_problems([job, claim])
    assert any(p.endswith(unknown) for p in problems), problems


def _pod_specs(cluster: dict) -> list[dict]:
    return [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]


def test_kuberay_rayjob_follows_what_kuberay_relies_on():
    job, claim = _rayjob_documents()
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    # The operator and the submitter pod reach the dashboard through the head Service: it must not
    # listen on loopback (KubeRay's default when unset is 0.0.0.0); the Service stays internal.
    assert head["rayStartParams"].get("dashboard-host", "0.0.0.0") not in ("127.0.0.1", "localhost", "::1")
    assert head.get("serviceType", "ClusterIP") == "ClusterIP" and not head.get("enableIngress")
    # Worker groups that may grow need the autoscaler, and the sweep must know it is there
    # (paratune.trial.placement.autoscaler_configured: it then waits for nodes instead of dropping plans).
    if any(g["maxReplicas"] > g["minReplicas"] for g in cluster["workerGroupSpecs"]):
        assert cluster["enableInTreeAutoscaling"] is True
        from paratune.trial.placement import autoscaler_configured

        env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PARATUNE_AUTOSCALER", env["PARATUNE_AUTOSCALER"])
            assert autoscaler_configured()
    # Every pod mounts the claim that the manifest itself creates, shared (RWX), and writable by
    # the image's group (uid 1000, gid 100 "users": kuberay/Dockerfile chowns to ray:users).
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["resources"]["requests"]["storage"]
    dockerfile = (REPO / "kuberay" / "Dockerfile").read_text()
    assert "--chown=ray:users" in dockerfile
    for pod in _pod_specs(cluster):
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [claim["metadata"]["name"]]
        assert pod["securityContext"]["fsGroup"] == 100
    # GPU pods tolerate the usual GPU-pool taint.
    for group in cluster["workerGroupSpecs"]:
        if any("nvidia.com/gpu" in c["resources"]["limits"] for c in group["template"]["spec"]["containers"]):
            assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists"
                       for t in group["template"]["spec"]["tolerations"])


def test_kuberay_rayjob_refers_to_what_exists():
    job, _ = _rayjob_documents()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    # The entrypoint's script and space exist in the image (/app is the repo) and the space loads.
    script, space = spec["entrypoint"].split()[1:3]
    assert (REPO / script.removeprefix("/app/")).is_file()
    load_space(REPO / space.removeprefix("/app/"))
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert env["PYTHONPATH"] == "/app/platform" and (REPO / "platform" / "paratune").is_dir()
    assert {"MLFLOW_TRACKING_URI", "PARATUNE_HOME", "PARATUNE_STORAGE"} <= set(env)
    assert env["PARATUNE_STORAGE"].startswith("/data/")  # on the shared volume
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] >= 1
    dockerfile = (REPO / "kuberay" / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}" in dockerfile and "constraints.txt" in dockerfile


def test_job_runtime_env_ships_the_code_and_no_secret():
    text = (REPO / "jobs" / "runtime_env.yaml").read_text()
    env = yaml.safe_load(text)
    assert env["working_dir"] == "." and {".venv", "paratune_runs", ".git"} <= set(env["excludes"])
    assert env["env_vars"]["PYTHONPATH"] == "platform"
    assert env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert "REQUIRED" in text  # shared PARATUNE_STORAGE on ray_cluster.yaml's shape
    from paratune.config.plan import SECRET_NAME

    assert not [k for k in env["env_vars"] if SECRET_NAME.search(k)]
