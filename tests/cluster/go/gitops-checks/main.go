// gitops-checks judges TrainingJobs the way GitOps tools do, with those tools' own code:
//
//	gitops-checks kstatus FILE...                  kstatus (Flux, kpt, cli-utils): {"status", "message"} per object
//	gitops-checks argocd-health SCRIPT FILE...     an Argo CD health.lua in gopher-lua: {"status", "message"}
//	gitops-checks argocd-action SCRIPT FILE        an Argo CD action.lua or discovery.lua: the table it returns
//
// FILE holds one object as JSON or YAML. Output is one JSON value per line, in argument order.
// The Lua state is set up as Argo CD sets up a customization from argocd-cm: no standard
// libraries beyond package, base and table (and a one-second limit), the object as the global obj.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/yaml"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: gitops-checks kstatus FILE... | argocd-health SCRIPT FILE... | argocd-action SCRIPT FILE")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "kstatus":
		err = kstatus(os.Args[2:])
	case "argocd-health":
		err = argocdHealth(os.Args[2], os.Args[3:])
	case "argocd-action":
		err = argocdAction(os.Args[2], os.Args[3:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "gitops-checks:", err)
		os.Exit(1)
	}
}

func readObject(path string) (map[string]interface{}, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	// through JSON into Unstructured, so integers stay int64 as the API machinery expects
	asJSON, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	object := &unstructured.Unstructured{}
	if err := object.UnmarshalJSON(asJSON); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return object.Object, nil
}

func emit(value interface{}) error {
	line, err := json.Marshal(value)
	if err != nil {
		return err
	}
	_, err = fmt.Println(string(line))
	return err
}

func kstatus(paths []string) error {
	for _, path := range paths {
		object, err := readObject(path)
		if err != nil {
			return err
		}
		result, err := status.Compute(&unstructured.Unstructured{Object: object})
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if err := emit(map[string]string{"status": result.Status.String(), "message": result.Message}); err != nil {
			return err
		}
	}
	return nil
}

var healthStatuses = map[string]bool{
	"Healthy": true, "Progressing": true, "Degraded": true, "Suspended": true, "Missing": true, "Unknown": true,
}

func argocdHealth(script string, paths []string) error {
	for _, path := range paths {
		result, err := runScript(script, path)
		if err != nil {
			return err
		}
		table, ok := result.(map[string]interface{})
		if !ok {
			return fmt.Errorf("%s: the script returned %T, not a table", path, result)
		}
		code, _ := table["status"].(string)
		if !healthStatuses[code] {
			// what Argo CD shows for a status it does not know
			table = map[string]interface{}{"status": "Unknown", "message": "Lua returned an invalid health status"}
		}
		if err := emit(table); err != nil {
			return err
		}
	}
	return nil
}

func argocdAction(script string, paths []string) error {
	if len(paths) != 1 {
		return errors.New("argocd-action takes one object")
	}
	result, err := runScript(script, paths[0])
	if err != nil {
		return err
	}
	if changed, ok := result.(map[string]interface{}); ok {
		original, err := readObject(paths[0])
		if err != nil {
			return err
		}
		result = restoreEmptyObjects(changed, original)
	}
	return emit(result)
}

// restoreEmptyObjects undoes what Lua cannot tell apart: an empty table comes back as [], so
// where the input held an object the empty result is an object again (Argo CD does the same).
func restoreEmptyObjects(changed, original map[string]interface{}) map[string]interface{} {
	for key, value := range changed {
		before, ok := original[key]
		if !ok {
			continue
		}
		switch v := value.(type) {
		case map[string]interface{}:
			if b, ok := before.(map[string]interface{}); ok {
				changed[key] = restoreEmptyObjects(v, b)
			}
		case []interface{}:
			if b, ok := before.(map[string]interface{}); ok && len(v) == 0 {
				changed[key] = b
			} else if b, ok := before.([]interface{}); ok {
				for i := range v {
					if i < len(b) {
						if vi, ok := v[i].(map[string]interface{}); ok {
							if bi, ok := b[i].(map[string]interface{}); ok {
								v[i] = restoreEmptyObjects(vi, bi)
							}
						}
					}
				}
			}
		}
	}
	return changed
}

func runScript(scriptPath, objectPath string) (interface{}, error) {
	script, err := os.ReadFile(scriptPath)
	if err != nil {
		return nil, err
	}
	object, err := readObject(objectPath)
	if err != nil {
		return nil, err
	}
	state := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer state.Close()
	for name, open := range map[string]lua.LGFunction{
		lua.LoadLibName: lua.OpenPackage, lua.BaseLibName: lua.OpenBase, lua.TabLibName: lua.OpenTable,
	} {
		if err := state.CallByParam(lua.P{Fn: state.NewFunction(open), Protect: true}, lua.LString(name)); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	state.SetContext(ctx)
	state.SetGlobal("obj", toLua(state, object))
	if err := state.DoString(string(script)); err != nil {
		return nil, fmt.Errorf("%s on %s: %w", scriptPath, objectPath, err)
	}
	return fromLua(state.Get(-1)), nil
}

func toLua(state *lua.LState, value interface{}) lua.LValue {
	switch v := value.(type) {
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case int64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case []interface{}:
		table := state.CreateTable(len(v), 0)
		for _, item := range v {
			table.Append(toLua(state, item))
		}
		return table
	case map[string]interface{}:
		table := state.CreateTable(0, len(v))
		for key, item := range v {
			table.RawSetString(key, toLua(state, item))
		}
		return table
	}
	return lua.LNil
}

// fromLua turns a returned table into JSON values; a table with only 1..n keys is an array
// (an empty table too, as Argo CD's encoder decides).
func fromLua(value lua.LValue) interface{} {
	switch v := value.(type) {
	case lua.LBool:
		return bool(v)
	case lua.LNumber:
		return float64(v)
	case lua.LString:
		return string(v)
	case *lua.LTable:
		if n := v.MaxN(); n > 0 || isEmpty(v) {
			items := make([]interface{}, 0, n)
			for i := 1; i <= n; i++ {
				items = append(items, fromLua(v.RawGetInt(i)))
			}
			return items
		}
		object := map[string]interface{}{}
		v.ForEach(func(key, item lua.LValue) { object[key.String()] = fromLua(item) })
		return object
	}
	return nil
}

func isEmpty(table *lua.LTable) bool {
	key, _ := table.Next(lua.LNil)
	return key == lua.LNil
}
