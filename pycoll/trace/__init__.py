"""The flight recorder (recorder.py: every communicator's last calls, dumped when a job fails or hangs)
and its analysis (analysis.py: line the ranks' dumps up and name the rank and call at fault;
`pycoll trace DIR`)."""
