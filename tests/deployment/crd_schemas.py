"""JSON schemas for the CRD objects deploy/k8s and the Helm chart render: the
Prometheus Operator's ServiceMonitor, PodMonitor and PrometheusRule, KEDA's
ScaledObject (keda.sh/v1alpha1, its Kafka trigger) and TriggerAuthentication, and
the Spark operator's SparkApplication.

kubernetes-validate knows only the core API, and the operator's CRDs (their
openAPIV3Schema) are not available offline here. These schemas are the part
of monitoring.coreos.com/v1 that our objects use, written from the CRDs'
field names and types: unknown fields are rejected (the API server would
silently prune them, so a typo would be lost without a word), durations use
the CRD's `Duration` pattern, and required fields are required.
"""

from __future__ import annotations

from typing import Any

# monitoring.coreos.com/v1 `Duration`.
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
NAME = {
    "type": "string",
    "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    "maxLength": 253,
}


def _object(
    kind: str, spec: dict[str, Any], api_version: str = "monitoring.coreos.com/v1"
) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": NAME,
                    "namespace": NAME,
                    "labels": STRING_MAP,
                    "annotations": STRING_MAP,
                },
                "additionalProperties": False,
            },
            "spec": spec,
        },
    }


RULE = {
    "type": "object",
    "required": ["expr"],
    "additionalProperties": False,
    "properties": {
        "alert": {"type": "string", "minLength": 1},
        "record": {"type": "string", "minLength": 1},
        "expr": {"type": ["string", "integer"]},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
}

PROMETHEUS_RULE = _object(
    "PrometheusRule",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["name", "rules"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": DURATION,
                        "query_offset": DURATION,
                        "limit": {"type": "integer"},
                        "partial_response_strategy": {"type": "string"},
                        "labels": STRING_MAP,
                        "rules": {"type": "array", "minItems": 1, "items": RULE},
                    },
                },
            }
        },
    },
)

LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": STRING_MAP,
        "matchExpressions": {"type": "array", "items": {"type": "object"}},
    },
}

SERVICE_MONITOR = _object(
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "additionalProperties": False,
        "properties": {
            "selector": LABEL_SELECTOR,
            "namespaceSelector": {"type": "object"},
            "jobLabel": {"type": "string"},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": DURATION,
                        "scrapeTimeout": DURATION,
                        "honorLabels": {"type": "boolean"},
                    },
                    "oneOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                },
            },
        },
    },
)

# keda.sh/v1alpha1 ScaledObject, the fields of KEDA's CRD our example uses; the Kafka
# scaler's metadata are strings (KEDA parses them), with the ones it requires.
KAFKA_TRIGGER_METADATA = {
    "type": "object",
    "required": ["bootstrapServers", "consumerGroup", "lagThreshold"],
    "additionalProperties": False,
    "properties": {
        name: {"type": "string", "minLength": 1}
        for name in ("bootstrapServers", "consumerGroup", "topic", "lagThreshold",
                     "activationLagThreshold", "offsetResetPolicy", "allowIdleConsumers",
                     "scaleToZeroOnInvalidOffset", "excludePersistentLag",
                     "limitToPartitionsWithLag", "partitionLimitation", "sasl", "tls")
    },
}  # fmt: skip
# The scaler's names for the SASL mechanism and TLS.
KAFKA_TRIGGER_METADATA["properties"] = {
    **KAFKA_TRIGGER_METADATA["properties"],  # type: ignore[dict-item]
    "sasl": {"enum": ["none", "plaintext", "scram_sha256", "scram_sha512", "oauthbearer",
                      "gssapi"]},
    "tls": {"enum": ["enable", "disable"]},
}  # fmt: skip
COUNT = {"type": "integer", "minimum": 0}
SCALED_OBJECT = _object(
    "ScaledObject",
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "additionalProperties": False,
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": NAME,
                    "kind": {"type": "string"},
                    "apiVersion": {"type": "string"},
                    "envSourceContainerName": {"type": "string"},
                },
            },
            "minReplicaCount": COUNT,
            "maxReplicaCount": COUNT,
            "idleReplicaCount": COUNT,
            "pollingInterval": COUNT,
            "cooldownPeriod": COUNT,
            "advanced": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"name": NAME, "behavior": {"type": "object"}},
                    },
                },
            },
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "additionalProperties": False,
                    "properties": {
                        "type": {"const": "kafka"},
                        "name": {"type": "string"},
                        "metadata": KAFKA_TRIGGER_METADATA,
                        "authenticationRef": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": NAME, "kind": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
    api_version="keda.sh/v1alpha1",
)

# keda.sh/v1alpha1 TriggerAuthentication: credentials from Secrets (secretTargetRef) or
# the scale target's environment (env), each naming the scaler parameter it sets.
TRIGGER_AUTHENTICATION = _object(
    "TriggerAuthentication",
    {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {
            "secretTargetRef": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["parameter", "name", "key"],
                    "additionalProperties": False,
                    "properties": {
                        # The Kafka scaler's authentication parameters.
                        "parameter": {
                            "enum": ["sasl", "username", "password", "tls", "ca", "cert",
                                     "key", "keyPassword", "oauthTokenEndpointUri", "scopes"]
                        },
                        "name": NAME,
                        "key": {"type": "string", "minLength": 1},
                    },
                },
            },
            "env": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["parameter", "name"],
                    "additionalProperties": False,
                    "properties": {
                        "parameter": {"type": "string"},
                        "name": {"type": "string"},
                        "containerName": {"type": "string"},
                    },
                },
            },
        },
    },
    api_version="keda.sh/v1alpha1",
)  # fmt: skip

POD_MONITOR = _object(
    "PodMonitor",
    {
        "type": "object",
        "required": ["selector", "podMetricsEndpoints"],
        "additionalProperties": False,
        "properties": {
            "selector": LABEL_SELECTOR,
            "namespaceSelector": {"type": "object"},
            "jobLabel": {"type": "string"},
            "podMetricsEndpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["port"],
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": DURATION,
                        "scrapeTimeout": DURATION,
                        "honorLabels": {"type": "boolean"},
                    },
                },
            },
        },
    },
)

# sparkoperator.k8s.io/v1beta2 (kubeflow/spark-operator's SparkApplication CRD):
# the fields our object uses, with the CRD's types and enums.
QUANTITY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?[kmgtKMGT]?i?$"}
ENV_VAR = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "value": {"type": "string"},
        "valueFrom": {"type": "object"},
    },
}
VOLUME_MOUNT = {
    "type": "object",
    "required": ["name", "mountPath"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string"},
        "mountPath": {"type": "string", "pattern": "^/"},
        "subPath": {"type": "string"},
        "readOnly": {"type": "boolean"},
    },
}
POD_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "cores": {"type": "integer", "minimum": 1},
        "coreLimit": {"type": "string"},
        "memory": QUANTITY,
        "instances": {"type": "integer", "minimum": 1},
        "serviceAccount": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "env": {"type": "array", "items": ENV_VAR},
        "volumeMounts": {"type": "array", "items": VOLUME_MOUNT},
        "ports": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "containerPort"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "containerPort": {"type": "integer"},
                    "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
                },
            },
        },
    },
}
SPARK_APPLICATION = _object(
    "SparkApplication",
    {
        "type": "object",
        "required": ["type", "mode", "mainApplicationFile", "sparkVersion", "driver", "executor"],
        "additionalProperties": False,
        "properties": {
            "type": {"enum": ["Java", "Python", "Scala", "R"]},
            "pythonVersion": {"enum": ["2", "3"]},
            "mode": {"enum": ["cluster", "client"]},
            "image": {"type": "string"},
            "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            "mainApplicationFile": {"type": "string"},
            "arguments": {"type": "array", "items": {"type": "string"}},
            "sparkVersion": {"type": "string"},
            "sparkConf": STRING_MAP,
            "deps": {"type": "object"},
            "restartPolicy": {
                "type": "object",
                "required": ["type"],
                "additionalProperties": False,
                "properties": {
                    "type": {"enum": ["Never", "Always", "OnFailure"]},
                    "onFailureRetries": {"type": "integer"},
                    "onFailureRetryInterval": {"type": "integer"},
                    "onSubmissionFailureRetries": {"type": "integer"},
                    "onSubmissionFailureRetryInterval": {"type": "integer"},
                },
            },
            "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
            "driver": POD_SPEC,
            "executor": POD_SPEC,
        },
    },
    api_version="sparkoperator.k8s.io/v1beta2",
)

SCHEMAS = {
    "PrometheusRule": PROMETHEUS_RULE,
    "ServiceMonitor": SERVICE_MONITOR,
    "ScaledObject": SCALED_OBJECT,
    "TriggerAuthentication": TRIGGER_AUTHENTICATION,
    "PodMonitor": POD_MONITOR,
    "SparkApplication": SPARK_APPLICATION,
}
