"""The bodies between the pool service and its node agents, each defined once
and used by both ends (docs/api.md, "Nodes" and "Agent").

- :mod:`.nodes`: agent -> service: the registration (``POST /nodes``) and the
  heartbeat (``POST /nodes/{name}/heartbeat``), their GPU, worker and
  environment entries, and the service's answers.
- :mod:`.workers`: service -> agent: the worker request (``POST /workers``)
  and the agent's answers (the started worker, the stopped one).

The client's bodies (lease request, lease) and the field rules every body uses
are in :mod:`gpupool.schema`. Each ``from_json`` raises a 400 GPUPoolError
naming the field; each ``to_json`` gives the dict sent. Fields unknown to a
reader are ignored, so older and newer parts interoperate.
"""
