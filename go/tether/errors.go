package tether

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
)

// The gRPC status codes' names that Tether's answers carry.
const (
	CodeInvalidArgument    = "INVALID_ARGUMENT"
	CodeFailedPrecondition = "FAILED_PRECONDITION"
	CodeNotFound           = "NOT_FOUND"
	CodePermissionDenied   = "PERMISSION_DENIED"
	CodeUnauthenticated    = "UNAUTHENTICATED"
	CodeResourceExhausted  = "RESOURCE_EXHAUSTED"
	CodeDeadlineExceeded   = "DEADLINE_EXCEEDED"
	CodeUnavailable        = "UNAVAILABLE"
	CodeOutOfRange         = "OUT_OF_RANGE"
	CodeAborted            = "ABORTED"
)

// Error is an answer of Tether other than success: the gRPC code's name,
// the server's message, and the HTTP status it came with.
type Error struct {
	Status  int
	Code    string
	Message string
	// LeaderID is the leader a follower named (0 when none).
	LeaderID uint64
}

func (e *Error) Error() string {
	return fmt.Sprintf("tether: %s: %s", e.Code, e.Message)
}

// CodeOf is err's code name when it is (or wraps) an *Error, else "".
func CodeOf(err error) string {
	var api *Error
	if errors.As(err, &api) {
		return api.Code
	}
	return ""
}

// errorOf reads a refusal's body and headers.
func errorOf(response *http.Response) error {
	body, _ := io.ReadAll(io.LimitReader(response.Body, 1<<20))
	var parsed struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	if err := json.Unmarshal(body, &parsed); err != nil || parsed.Code == "" {
		// Not Tether's answer (a proxy's, say): keep what it said.
		parsed.Code = "UNKNOWN"
		if response.StatusCode == http.StatusServiceUnavailable {
			parsed.Code = CodeUnavailable
		}
		parsed.Message = fmt.Sprintf("HTTP %d: %s", response.StatusCode, string(body))
	}
	leader, _ := strconv.ParseUint(response.Header.Get("x-tether-leader-id"), 10, 64)
	return &Error{Status: response.StatusCode, Code: parsed.Code, Message: parsed.Message, LeaderID: leader}
}
