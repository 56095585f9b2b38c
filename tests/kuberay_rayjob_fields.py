"""The field names KubeRay's ray.io/v1 RayJob documents, for the parts of it that
kuberay/rayjob.yaml uses, written out by hand as test data (tests/test_cluster_config.py walks
the manifest against it).

Read from KubeRay v1.7.0 (github.com/ray-project/kuberay, tag v1.7.0):
  ray-operator/apis/ray/v1/rayjob_types.go      RayJobSpec, SubmitterConfig
  ray-operator/apis/ray/v1/raycluster_types.go  RayClusterSpec, AuthOptions, AutoscalerOptions,
                                                HeadGroupSpec, WorkerGroupSpec, ScaleStrategy
  helm-chart/kuberay-operator/crds/ray.io_rayjobs.yaml  (the same names as the CRD's schema)
Every name used by kuberay/rayjob.yaml also exists in v1.5.1, the oldest KubeRay the manifest
supports (authOptions arrived in 1.5).

Pod templates are checked against a working subset of Kubernetes core/v1 (PodTemplateSpec,
PodSpec, Container, Volume, ...): the fields a Ray pod template plausibly uses. A field that is
valid Kubernetes but missing here fails the test too: add it here, from the core/v1 API reference.

How a tree reads: a dict lists an object's field names (each maps to the tree of its value);
[tree] is a list whose items follow tree; MAP is a map with free-form keys (labels, resource
quantities); ANY is a value the walk does not look into (a scalar, or an object this repo does
not use); RAY_START is rayStartParams, whose keys must be options of the installed `ray start`.
"""

MAP = "map"
ANY = "any"
RAY_START = "ray-start-params"

KUBERAY_VERSION = "v1.7.0"

OBJECT_META = {"name": ANY, "namespace": ANY, "labels": MAP, "annotations": MAP}

# --- Kubernetes core/v1 (a working subset) ---------------------------------------------------

ENV_VAR = {"name": ANY, "value": ANY, "valueFrom": ANY}

VOLUME_MOUNT = {"name": ANY, "mountPath": ANY, "readOnly": ANY, "subPath": ANY, "subPathExpr": ANY,
                "mountPropagation": ANY, "recursiveReadOnly": ANY}

RESOURCE_REQUIREMENTS = {"requests": MAP, "limits": MAP, "claims": ANY}

CONTAINER_SECURITY_CONTEXT = {
    "capabilities": {"add": [ANY], "drop": [ANY]}, "privileged": ANY, "runAsUser": ANY, "runAsGroup": ANY,
    "runAsNonRoot": ANY, "readOnlyRootFilesystem": ANY, "allowPrivilegeEscalation": ANY,
    "seccompProfile": ANY, "seLinuxOptions": ANY, "procMount": ANY, "appArmorProfile": ANY,
}

CONTAINER = {
    "name": ANY, "image": ANY, "imagePullPolicy": ANY, "command": [ANY], "args": [ANY], "workingDir": ANY,
    "env": [ENV_VAR], "envFrom": ANY,
    "ports": [{"name": ANY, "containerPort": ANY, "protocol": ANY, "hostPort": ANY, "hostIP": ANY}],
    "resources": RESOURCE_REQUIREMENTS, "volumeMounts": [VOLUME_MOUNT], "volumeDevices": ANY,
    "securityContext": CONTAINER_SECURITY_CONTEXT, "lifecycle": ANY, "livenessProbe": ANY,
    "readinessProbe": ANY, "startupProbe": ANY, "stdin": ANY, "stdinOnce": ANY, "tty": ANY,
    "terminationMessagePath": ANY, "terminationMessagePolicy": ANY, "resizePolicy": ANY, "restartPolicy": ANY,
}

VOLUME = {
    "name": ANY,
    "persistentVolumeClaim": {"claimName": ANY, "readOnly": ANY},
    "emptyDir": {"medium": ANY, "sizeLimit": ANY},
    "hostPath": {"path": ANY, "type": ANY},
    "nfs": {"server": ANY, "path": ANY, "readOnly": ANY},
    "configMap": ANY, "secret": ANY, "csi": ANY, "projected": ANY, "ephemeral": ANY, "downwardAPI": ANY,
}

POD_SECURITY_CONTEXT = {
    "fsGroup": ANY, "fsGroupChangePolicy": ANY, "runAsUser": ANY, "runAsGroup": ANY, "runAsNonRoot": ANY,
    "supplementalGroups": [ANY], "supplementalGroupsPolicy": ANY, "seccompProfile": ANY,
    "seLinuxOptions": ANY, "sysctls": [{"name": ANY, "value": ANY}], "appArmorProfile": ANY,
}

TOLERATION = {"key": ANY, "operator": ANY, "value": ANY, "effect": ANY, "tolerationSeconds": ANY}

POD_SPEC = {
    "containers": [CONTAINER], "initContainers": [CONTAINER], "volumes": [VOLUME],
    "securityContext": POD_SECURITY_CONTEXT, "tolerations": [TOLERATION], "nodeSelector": MAP,
    "affinity": ANY, "topologySpreadConstraints": ANY, "serviceAccountName": ANY,
    "automountServiceAccountToken": ANY, "priorityClassName": ANY, "schedulerName": ANY,
    "runtimeClassName": ANY, "restartPolicy": ANY, "terminationGracePeriodSeconds": ANY,
    "activeDeadlineSeconds": ANY, "imagePullSecrets": [{"name": ANY}], "hostNetwork": ANY, "hostIPC": ANY,
    "hostPID": ANY, "dnsPolicy": ANY, "dnsConfig": ANY, "shareProcessNamespace": ANY,
    "enableServiceLinks": ANY, "hostname": ANY, "subdomain": ANY,
}

POD_TEMPLATE = {"metadata": OBJECT_META, "spec": POD_SPEC}

# --- KubeRay ray.io/v1 ----------------------------------------------------------------------

AUTH_OPTIONS = {"mode": ANY, "secretName": ANY, "enableK8sTokenAuth": ANY}

AUTOSCALER_OPTIONS = {
    "resources": RESOURCE_REQUIREMENTS, "image": ANY, "imagePullPolicy": ANY,
    "securityContext": CONTAINER_SECURITY_CONTEXT, "idleTimeoutSeconds": ANY, "upscalingMode": ANY,
    "version": ANY, "env": [ENV_VAR], "envFrom": ANY, "volumeMounts": [VOLUME_MOUNT], "command": [ANY],
    "args": [ANY],
}

HEAD_GROUP_SPEC = {
    "template": POD_TEMPLATE, "headService": ANY, "enableIngress": ANY, "ingressOptions": ANY,
    "resources": MAP, "labels": MAP, "rayStartParams": RAY_START, "serviceType": ANY,
}

WORKER_GROUP_SPEC = {
    "suspend": ANY, "groupName": ANY, "replicas": ANY, "minReplicas": ANY, "maxReplicas": ANY,
    "idleTimeoutSeconds": ANY, "priority": ANY, "resources": MAP, "labels": MAP,
    "rayStartParams": RAY_START, "template": POD_TEMPLATE, "scaleStrategy": {"workersToDelete": [ANY]},
    "numOfHosts": ANY,
}

RAY_CLUSTER_SPEC = {
    "upgradeStrategy": ANY, "authOptions": AUTH_OPTIONS, "suspend": ANY, "managedBy": ANY,
    "autoscalerOptions": AUTOSCALER_OPTIONS, "headServiceAnnotations": MAP, "enableInTreeAutoscaling": ANY,
    "gcsFaultToleranceOptions": ANY, "historyServerOptions": ANY, "networkPolicy": ANY, "tlsOptions": ANY,
    "headGroupSpec": HEAD_GROUP_SPEC, "rayVersion": ANY, "workerGroupSpecs": [WORKER_GROUP_SPEC],
}

RAY_JOB_SPEC = {
    "activeDeadlineSeconds": ANY, "backoffLimit": ANY, "rayClusterSpec": RAY_CLUSTER_SPEC,
    "submitterPodTemplate": POD_TEMPLATE, "metadata": MAP, "clusterSelector": MAP,
    "submitterConfig": {"backoffLimit": ANY}, "managedBy": ANY, "deletionStrategy": ANY, "entrypoint": ANY,
    "runtimeEnvYAML": ANY, "jobId": ANY, "submissionMode": ANY, "entrypointResources": ANY,
    "entrypointNumCpus": ANY, "entrypointNumGpus": ANY, "ttlSecondsAfterFinished": ANY,
    "preRunningDeadlineSeconds": ANY, "shutdownAfterJobFinishes": ANY, "suspend": ANY,
}

RAY_JOB = {"apiVersion": ANY, "kind": ANY, "metadata": OBJECT_META, "spec": RAY_JOB_SPEC}

# --- core/v1 PersistentVolumeClaim (the second document of the manifest) ---------------------

PERSISTENT_VOLUME_CLAIM = {
    "apiVersion": ANY, "kind": ANY, "metadata": OBJECT_META,
    "spec": {"accessModes": [ANY], "storageClassName": ANY, "resources": RESOURCE_REQUIREMENTS,
             "volumeMode": ANY, "volumeName": ANY, "selector": ANY, "dataSource": ANY,
             "dataSourceRef": ANY, "volumeAttributesClassName": ANY},
}

BY_KIND = {("ray.io/v1", "RayJob"): RAY_JOB, ("v1", "PersistentVolumeClaim"): PERSISTENT_VOLUME_CLAIM}
