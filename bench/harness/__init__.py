"""What every benchmark needs: child processes and their cleanup, embedded or
given servers, CPU probes and noise control, rounds and ratios, the JSON
report, and py-spy profiles whose buckets are checked against the live code."""
