-- Argo CD health of a phalanx TrainingJob, from the conditions the operator writes.
-- Runs as an argocd-cm customization: only the base and table libraries are there.
local hs = { status = "Progressing", message = "Waiting for the phalanx operator" }
local status = obj.status
if status == nil then
  return hs
end
local generation = obj.metadata.generation or 0
if (status.observedGeneration or 0) < generation then
  hs.message = "Waiting for the phalanx operator to observe generation " .. tostring(generation)
  return hs
end
local conditions = {}
for _, condition in ipairs(status.conditions or {}) do
  conditions[condition.type] = condition
end
local function holds(kind)
  return conditions[kind] ~= nil and conditions[kind].status == "True"
end
local function summary(kind)
  local text = status.message or ""
  if conditions[kind] ~= nil and conditions[kind].message ~= nil and conditions[kind].message ~= "" then
    text = conditions[kind].message
  end
  if status.reason ~= nil and status.reason ~= "" then
    return status.reason .. ": " .. text
  end
  return text
end
if holds("Failed") then
  hs.status = "Degraded"
  hs.message = summary("Failed")
elseif holds("Stalled") then
  -- a running job with an unusable spec, a job that can never be placed, a missing gang scheduler
  hs.status = "Degraded"
  hs.message = summary("Stalled")
elseif holds("Suspended") then
  hs.status = "Suspended"
  hs.message = summary("Suspended")
elseif holds("Succeeded") then
  hs.status = "Healthy"
  hs.message = summary("Succeeded")
elseif holds("Ready") and not holds("Reconciling") then
  hs.status = "Healthy"
  hs.message = summary("Ready")
elseif status.phase ~= nil then
  -- Pending, Starting, Rescaling, Restarting: converging, with the operator's reason
  hs.message = summary("Reconciling")
end
return hs
