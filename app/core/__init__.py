"""The core every layer may use: settings, job kinds and states, priorities, ids, the log format."""
