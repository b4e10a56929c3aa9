"""What the controller runs: the factory's builder, the synchronizer and its options, group
membership and formation, the waits on participants, staging, status probes and failure
reports."""
