#!/usr/bin/env python3
"""A stand-in Kubernetes API server that only answers discovery, so that
`kubectl apply --dry-run=client` can run without a cluster (kubectl maps each manifest's kind
to a resource through discovery and then GETs the live object, which here never exists).

    python3 deploy/k8s/offline_api.py PORT_FILE     # writes its port, serves until killed

It knows the kinds deploy/k8s/ uses (Service, ConfigMap, StatefulSet, Deployment,
PodDisruptionBudget). Schema validation needs a cluster's OpenAPI document, so kubectl runs
with --validate=false; deploy/lint_deploy.py checks the manifests' structure instead."""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CORE = {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "v1", "resources": [
    {"name": "services", "singularName": "service", "namespaced": True, "kind": "Service",
     "verbs": ["create", "get", "list", "patch", "update", "delete"]},
    {"name": "configmaps", "singularName": "configmap", "namespaced": True,
     "kind": "ConfigMap", "verbs": ["create", "get", "list", "patch", "update", "delete"]},
    {"name": "namespaces", "singularName": "namespace", "namespaced": False,
     "kind": "Namespace", "verbs": ["create", "get", "list", "patch", "update", "delete"]},
]}
GROUPS = {
    "apps/v1": [("statefulsets", "StatefulSet"), ("deployments", "Deployment")],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
}


def resource_list(gv, kinds):
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": [
        {"name": n, "singularName": k.lower(), "namespaced": True, "kind": k,
         "verbs": ["create", "get", "list", "patch", "update", "delete"]} for n, k in kinds]}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path == "/api":
            return self.reply(200, {"kind": "APIVersions", "versions": ["v1"],
                                    "serverAddressByClientCIDRs": []})
        if path == "/api/v1":
            return self.reply(200, CORE)
        if path == "/apis":
            groups = []
            for gv in GROUPS:
                g, v = gv.split("/")
                ver = {"groupVersion": gv, "version": v}
                groups.append({"name": g, "versions": [ver], "preferredVersion": ver})
            return self.reply(200, {"kind": "APIGroupList", "apiVersion": "v1",
                                    "groups": groups})
        for gv, kinds in GROUPS.items():
            if path == f"/apis/{gv}":
                return self.reply(200, resource_list(gv, kinds))
        if path == "/version":
            return self.reply(200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0"})
        # Any object: not there (so `apply` would create it).
        self.reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                         "reason": "NotFound", "code": 404, "message": "not found"})


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(sys.argv[1], "w") as f:
        f.write(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main()
