-- Resource actions of a TrainingJob: suspend stops every pod (no budget spent), resume starts a new attempt.
local actions = {}
local suspended = obj.spec ~= nil and obj.spec.suspend == true
actions["suspend"] = { ["disabled"] = suspended, ["iconClass"] = "fa fa-fw fa-pause-circle" }
actions["resume"] = { ["disabled"] = not suspended, ["iconClass"] = "fa fa-fw fa-play-circle" }
return actions
