"""Commands that inspect or break a port: the fault lab, the HLO byte audit, the XLA shape check."""
