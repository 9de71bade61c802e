"""Every body between the parts of the pool, each defined once and used by
both ends (docs/api.md).

- :mod:`.leases`: client <-> service: the lease request (``POST /leases``)
  and the lease (every answer about one, written by the service with the
  class the client reads it with).
- :mod:`.nodes`: agent -> service: the registration (``POST /nodes``) and the
  heartbeat (``POST /nodes/{name}/heartbeat``), their GPU, worker and
  environment entries, and the service's answers.
- :mod:`.workers`: service -> agent: the worker request (``POST /workers``)
  and the agent's answers (the started worker, the stopped one).
- :mod:`.quotas`: service -> client: a user's limits (also the body of
  ``PUT /admin/quotas/{scope}``) and the ``GET /quota`` answer.
- :mod:`.pool`: service -> client: the ``GET /pool`` answer (nodes, GPUs, totals).
- :mod:`.hub`: JupyterHub -> service: a server stopped (``POST /hub/server-stopped``).
- :mod:`.magic`: worker -> notebook kernel: ``%gpu`` in a cell on the worker,
  asked over the worker's stdin channel.
- :mod:`.status`: front end <-> notebook kernel: the ``gpupool.status`` comm
  (its TypeScript side, ``labextension/src``, is checked against it).
- :mod:`.transfer`: notebook kernel or agent -> worker: the ``gpupool.transfer``
  comm's ops, one request class each.

The field rules every HTTP body uses are in :mod:`gpupool.schema`. Each
HTTP body's ``from_json`` raises a 400 GPUPoolError naming the field; each
``to_json`` gives the dict sent. The lease request refuses fields it does not
know; the other readers ignore them, so older and newer parts interoperate.
The comms' modules (``magic``, ``status``, ``transfer``) import only the
standard library and :mod:`gpupool.strenum`: a worker's extension imports them.
"""
