"""The SLA planner: sizes each worker pool from live load (``conveyor planner``).

It reads the workers' heartbeats, the pools' queues and the API's traffic counters from
Redis (:mod:`planner.inputs`), fits a performance model per pool (:mod:`planner.model`),
forecasts the load (:mod:`planner.forecast`), decides in two loops (:mod:`planner.core`)
and hands each decision to a connector (:mod:`planner.connectors`) that acts on it."""
