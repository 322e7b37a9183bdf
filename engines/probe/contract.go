package probe

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
)

// CheckLifecycle runs an engine's own checks as readmission and preflight
// do (behaviour.md R-BRK-6, R-PRE-1): engines.CheckHealth bounded by
// timeout, then, within a second window of timeout, engines.ServedModels
// when contract pins no model and CheckContract when there is a contract.
// It returns the model e's probes use — contract.Model, else the first
// model e serves — and nil, or the first check's error (CheckHealth's,
// ServedModels' or CheckContract's). The model is "" when the health
// check or the model list failed, and still set when only the contract
// check failed.
func CheckLifecycle(ctx context.Context, httpc *http.Client, e *engines.Engine, contract *config.Contract, timeout time.Duration) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	err := engines.CheckHealth(cctx, httpc, e)
	cancel()
	if err != nil {
		return "", err
	}
	cctx, cancel = context.WithTimeout(ctx, timeout)
	defer cancel()
	var model string
	if contract != nil && contract.Model != "" {
		model = contract.Model
	} else {
		models, err := engines.ServedModels(cctx, httpc, e)
		if err != nil {
			return "", err
		}
		model = models[0].ID
	}
	if contract != nil {
		if err := CheckContract(cctx, httpc, e, contract); err != nil {
			return model, err
		}
	}
	return model, nil
}

// ContractError is one way an engine breaks the pinned engine contract
// (behaviour.md R-BRK-6, R-PRE-1).
type ContractError struct {
	// EngineID is the engine checked.
	EngineID string
	// Field is the contract key broken: "model", "engine", "version" or
	// "connector".
	Field string
	// Want is the contract's value, Got what the engine has.
	Want, Got string
}

// Error returns "engine <id> breaks engine_contract.<field>: want <want>,
// got <got>".
func (e *ContractError) Error() string {
	return "engine " + e.EngineID + " breaks engine_contract." + e.Field + ": want " + e.Want + ", got " + e.Got
}

// CheckContract validates e against contract (behaviour.md R-BRK-6,
// R-PRE-1): the contract's model is listed by GET /v1/models
// (engines.ServedModels); the engine kind (GET /version "engine", else the
// model's owned_by) equals the contract's, ignoring case; the version from
// GET /version (engines.ReadVersion) satisfies the contract's constraint
// (config.VersionSatisfies); and the engine's connector from the fleet
// config (e.Connector) is the contract's. Empty contract fields pin
// nothing; a nil contract only requires /v1/models to list a model. ctx
// bounds the requests.
//
// It returns nil, the joined *ContractError of every mismatch, or an error
// naming the engine when an endpoint cannot be read.
func CheckContract(ctx context.Context, httpc *http.Client, e *engines.Engine, contract *config.Contract) error {
	models, err := engines.ServedModels(ctx, httpc, e)
	if err != nil {
		return err
	}
	if contract == nil {
		return nil
	}
	var errs []error
	mismatch := func(field, want, got string) {
		errs = append(errs, &ContractError{EngineID: e.ID, Field: field, Want: want, Got: got})
	}
	served := models[0]
	if contract.Model != "" {
		i := slices.IndexFunc(models, func(m engines.ServedModel) bool { return m.ID == contract.Model })
		if i < 0 {
			ids := make([]string, len(models))
			for j, m := range models {
				ids[j] = strconv.Quote(m.ID)
			}
			mismatch("model", strconv.Quote(contract.Model), "models "+strings.Join(ids, ", "))
		} else {
			served = models[i]
		}
	}
	if contract.Engine != "" || contract.Version != "" {
		v, err := engines.ReadVersion(ctx, httpc, e)
		if err != nil {
			return err
		}
		kind := v.Engine
		if kind == "" {
			kind = served.OwnedBy
		}
		if contract.Engine != "" && !strings.EqualFold(kind, contract.Engine) {
			mismatch("engine", strconv.Quote(contract.Engine), strconv.Quote(kind))
		}
		if contract.Version != "" {
			ok, err := config.VersionSatisfies(v.Version, contract.Version)
			if err != nil {
				mismatch("version", strconv.Quote(contract.Version), strconv.Quote(v.Version)+" ("+err.Error()+")")
			} else if !ok {
				mismatch("version", strconv.Quote(contract.Version), strconv.Quote(v.Version))
			}
		}
	}
	if contract.Connector != "" {
		got := ""
		if e.Connector != nil {
			got = e.Connector.Name()
		}
		if got != contract.Connector {
			mismatch("connector", strconv.Quote(contract.Connector), strconv.Quote(got))
		}
	}
	return errors.Join(errs...)
}
