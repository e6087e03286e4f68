"""The fleet: every engine of the job, its routers, health, recovery and weight updates.

`fleet.Fleet` keeps the lock, the version and the update transaction and decides
(`supervision` applies its parts' advice under the lock); `launcher`, `routers`, `health`,
`recovery`, `offload` and `generation` are its parts, `lifecycle` the table of phases and
one engine's record, `events` the one event type, `push` weight pushes from a process of
your own (`FleetWeights`), `stream` the fully-async producer (`RolloutStream`).
"""
