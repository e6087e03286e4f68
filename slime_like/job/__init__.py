"""The job: inputs and preflight, the dry run, the checks on every step's samples, the KL
term, the checkpoint policy, and the `Job` that runs the steps."""
