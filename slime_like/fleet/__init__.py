"""The fleet: every engine of the job, its routers, health, recovery and weight updates.

`fleet.Fleet` keeps the lock, the version and the update transaction; `launcher`, `routers`,
`health`, `recovery` and `offload` are its parts, `lifecycle` the table of states and one
engine's record, `events` the one event type, `push` weight pushes from a process of your
own (`FleetWeights`).
"""
