"""Slurm: queued jobs on dtrain's own clusters (gcp, and hosts with `slurm = true`) and on Slurm clusters
users already have (backend = "slurm").

    spec.py      what a Cluster says about its Slurm (SlurmSpec): the login node, partition, account, ...
    commands.py  Slurm's commands on the login node over SSH (sbatch, scontrol, sacct, scancel, sinfo),
                 their output parsed and their states mapped
    script.py    a job's files: the batch script and job.json (dtrain.common.slurmstep runs them)
    session.py   the job table on the login node (JobRecord) and a Session: SSH and Slurm's commands there
    submit.py    queue a built-in or one module (an evaluation); the steps every submission shares
    joblist.py   `dtrain jobs`: each job with Slurm's view, its node-hours, cost and stall
    cancel.py    cancel a job: its ranks checkpoint and stop
    joblogs.py   a job's logs, read or followed live
    attend.py    `dtrain train` through Slurm: the queued job followed until it ends, its exit code ours
    programs.py  a user's own program as a job (submit, and `dtrain train` through Slurm): its code synced,
                 its requirements and checkpoint directory handled on the nodes
    setup.py     Slurm and munge configured and started on dtrain's own clusters; doctor's Slurm checks

dtrain writes no scheduler: Slurm queues, allocates, requeues and accounts; dtrain writes the batch
script, keeps a small job table (job id -> run) on the login node, and reads Slurm's own records.
"""
