"""The shipped cluster configs: ray_cluster.yaml against Ray's own schema, the KubeRay RayJob
against what it refers to, and the job runtime env."""

from pathlib import Path

import pytest
import ray
import yaml

from paratune.space import load_space

REPO = Path(__file__).resolve().parents[1]


def _validate(config: dict) -> dict:
    """What `ray up` does before it touches a cloud: fill the provider's defaults, then validate
    against ray/autoscaler/ray-schema.json and the launcher's own rules."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(config)
    validate_config(prepared)
    return prepared


def test_ray_cluster_yaml_validates_against_rays_schema():
    config = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    prepared = _validate(config)
    # Same Ray as the driver; a CPU head that never hosts a GPU worker; GPU worker types.
    assert ray.__version__ in config["docker"]["image"] and ray.__version__ in config["docker"]["head_image"]
    head = prepared["head_node_type"]
    assert prepared["available_node_types"][head]["max_workers"] == 0
    assert any("gpu" in name for name in prepared["available_node_types"] if name != head)
    # Safe defaults: the dashboard/job server and MLflow listen on 127.0.0.1 only; token auth.
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    assert "--host 127.0.0.1" in head_start and "RAY_AUTH_MODE=token" in head_start
    assert all("RAY_AUTH_MODE=token" in c for c in config["worker_start_ray_commands"] if "ray start" in c)
    assert any("constraints.txt" in c and "-e ~/paratune" in c for c in config["setup_commands"])


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["available_node_types"]["head"].update(typo_field=1), "typo_field"),
    (lambda c: c.update(head_node_type="nope"), "head_node_type"),
    (lambda c: c["available_node_types"]["gpu_8x_h100"].update(min_workers="two"), "two"),
])
def test_the_schema_check_catches_a_broken_config(mutate, message):
    config = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    mutate(config)
    with pytest.raises(Exception, match=message):
        _validate(config)


def test_kuberay_rayjob_refers_to_what_exists():
    job = yaml.safe_load((REPO / "kuberay" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"]["mode"] == "token"
    assert cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    # The entrypoint's script and space exist in the image (/app is the repo) and the space loads.
    script, space = spec["entrypoint"].split()[1:3]
    assert (REPO / script.removeprefix("/app/")).is_file()
    load_space(REPO / space.removeprefix("/app/"))
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    assert env["PYTHONPATH"] == "/app/platform" and (REPO / "platform" / "paratune").is_dir()
    assert {"MLFLOW_TRACKING_URI", "PARATUNE_HOME", "PARATUNE_STORAGE"} <= set(env)
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] >= 1
    dockerfile = (REPO / "kuberay" / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}" in dockerfile and "constraints.txt" in dockerfile


def test_job_runtime_env_ships_the_code_and_no_secret():
    env = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "." and {".venv", "paratune_runs", ".git"} <= set(env["excludes"])
    assert env["env_vars"]["PYTHONPATH"] == "platform"
    assert env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    from paratune.plan import SECRET_NAME

    assert not [k for k in env["env_vars"] if SECRET_NAME.search(k)]
