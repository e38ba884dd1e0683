#!/bin/sh
# Renders each overlay into rendered/<overlay>.yaml (checked in, so `kubectl apply -f` works
# without kustomize and reviews show the effective manifests). Needs kubectl (kustomize built in).
# A test re-renders and fails when these files are stale.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
kubectl=${KUBECTL:-kubectl}
for overlay in "$here"/overlays/*/; do
  name=$(basename "$overlay")
  {
    echo "# Rendered from deploy/k8s/overlays/$name by deploy/k8s/render.sh: do not edit."
    "$kubectl" kustomize "$overlay"
  } > "$here/rendered/$name.yaml"
done
