"""What the runtime tells the fleet it runs in (issue 33): its pod's deletion cost
(``runtime.fleet.deletion_cost``). Knows nothing of the engine or the front end; they call it."""
