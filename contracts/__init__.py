"""The contract between the two deployables: what the backend (API, scheduler) and the
worker (agents, training engine) say to each other. It imports neither of them and holds
no database access, so either side can import it alone.

- :mod:`contracts.strict`: the strict base of every request body (unknown fields and NUL
  characters refused by name).
- :mod:`contracts.plan`: one resource group's part in a task (`GroupPlan`), device types,
  split policies.
- :mod:`contracts.preprocess`: the per-task preprocessing steps a user may request.
- :mod:`contracts.payload`: the sub-task payload of one dispatch message and the limits of
  a task's ranks.
- :mod:`contracts.messaging`: queue and message names and the broker options both sides use.
- :mod:`contracts.agent_api`: the bodies agents send to the internal API (claim, rendezvous,
  progress, metrics, logs, finished, heartbeat) and what it answers.
"""
