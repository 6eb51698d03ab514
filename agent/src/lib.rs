//! nextn-agent: the agent loop and its clients (later issues), and the `nextn` binary's commands.
