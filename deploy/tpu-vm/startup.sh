#!/bin/bash
# A TPU VM's startup script: tpud into a virtual environment, then installed as a service and started.
# Give it with `gcloud compute tpus tpu-vm create ... --metadata-from-file=startup-script=startup.sh`
# and the settings as metadata (docs/fleet.md): tpud-remote-jobs, tpud-gang-port, tpud-metrics-addr,
# and tpud-pip-spec, what pip installs (default: tpud[tpu]; a wheel's gs:// path is copied first).
# It runs at every boot: an installed tpud is upgraded to the spec and the service restarted.
set -euo pipefail
attribute() {  # attribute NAME DEFAULT: this VM's metadata attribute, or DEFAULT when it is unset
    curl -sf -H 'Metadata-Flavor: Google' \
        "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" || echo "$2"
}
spec=$(attribute tpud-pip-spec 'tpud[tpu]')
venv=/opt/tpud
if [[ $spec == gs://* ]]; then
    mkdir -p /opt/tpud-wheels
    gcloud storage cp "$spec" /opt/tpud-wheels/
    spec=/opt/tpud-wheels/$(basename "$spec")
fi
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet --upgrade "$spec"
"$venv/bin/tpud" install-service --from-metadata --overwrite
systemctl restart tpud
