# /etc/gpupool/gpupool_config.py for the systemd units: the service and the agents read the same
# file (each only its own classes). deploy/systemd/README.md, "Three GPU hosts and a hub".
from pathlib import Path

c = get_config()  # noqa: F821 (traitlets provides it)

# -- the service (hub host) --------------------------------------------------------------------
# Kernels and agents reach it at this URL (the certificate /etc/gpupool/service.crt names this host).
c.GPUPool.public_url = "https://hub.example.org:8765/"
c.GPUPool.db_url = "postgresql+psycopg://gpupool@/gpupool?host=/run/postgresql"
# The agents' token: the same file is copied to each GPU host as /etc/gpupool/agent_token.
if Path("/etc/gpupool/agent_token").exists():
    c.GPUPool.agent_token = Path("/etc/gpupool/agent_token").read_text().strip()
c.GPUPool.metrics_token_file = "/etc/gpupool/metrics_token"
# Admins (`gpupool quota set ...`, anyone's lease): the service's account, User=gpupool in its unit. Without
# c.GPUPool.api_tokens its token is the service's /var/lib/gpupool/service/user_token (README steps 6 and 7);
# people get tokens of their own with c.GPUPool.api_tokens = {TOKEN: "ann"} and are named here.
c.GPUPool.admin_users = {"gpupool"}
c.PoolQuotas.quotas = {"*": {"max_gpus": 1, "gpu_hours_per_day": 8}}

# -- the agents (GPU hosts) --------------------------------------------------------------------
# Worker environments on the GPU hosts: name -> Python interpreter or prefix (README, "Worker environments").
c.AgentWorkers.environments = {"python3": "/opt/gpupool/bin/python"}
