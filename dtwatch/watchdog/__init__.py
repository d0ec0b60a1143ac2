"""The node watchdog, a process of its own: reads the rings, diagnoses, keeps incidents, talks to the
other nodes and the job's console."""
