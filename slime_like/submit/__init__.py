"""Getting a job onto Ray: a private local cluster (`local_cluster`), the job's submission
(`ray_job`), and the job's own connection to its cluster (`connect.init_ray`)."""
