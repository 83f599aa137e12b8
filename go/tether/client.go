// Package tether is a client of Tether's HTTP/JSON API for Go programs —
// schedulers, device plugins, operators — with the standard library only:
// no gRPC, no client-go.
//
// A Client knows every replica's HTTP port and follows the leader: a
// follower answers a write with 503 UNAVAILABLE naming the leader
// (x-tether-leader-id), every answer names the replica that gave it
// (x-tether-node-id), and the client goes where the leader is. Writes carry
// request ids, so a write retried after a lost answer or a leader change is
// applied once. Unary calls retry an unavailable cluster for
// Config.RetryTimeout (or until the context ends); Acquire waits in the
// lock's FIFO queue and keeps its place across a leader change.
//
// See nodelock for HAMi's node-lock operations on top of this client.
package tether

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Config says how to reach a Tether cluster.
type Config struct {
	// Endpoints are the replicas' HTTP ports, e.g. "http://10.0.0.5:7421"
	// or "https://tether-0.tether:7421". At least one.
	Endpoints []string
	// Token is sent as "authorization: Bearer <token>": one of tetherd's
	// --auth-tokens.
	Token string
	// TLS is used for https endpoints: RootCAs holding Tether's CA, and
	// the client certificate (whose name is the caller's role) in
	// Certificates.
	TLS *tls.Config
	// RetryTimeout bounds how long a call follows leaders and retries an
	// unavailable cluster. Default 15s; a context deadline that comes
	// sooner wins.
	RetryTimeout time.Duration
	// CallTimeout bounds one attempt of a unary call. Default 5s.
	CallTimeout time.Duration
	// ClientID names this client process in request ids. Default: random.
	ClientID string
}

// Client calls one Tether cluster. It is safe for concurrent use.
type Client struct {
	endpoints []string
	token     string
	retry     time.Duration
	attempt   time.Duration
	clientID  string
	http      *http.Client

	mu       sync.Mutex
	current  int            // the endpoint believed to lead
	nodeIDs  map[uint64]int // node id -> endpoint, learned from answers
	sequence uint64
	inFlight map[uint64]struct{}
}

// New makes a client; nothing is dialled until the first call.
func New(config Config) (*Client, error) {
	if len(config.Endpoints) == 0 {
		return nil, errors.New("tether: no endpoints: give the replicas' HTTP addresses, e.g. http://127.0.0.1:7421")
	}
	endpoints := make([]string, 0, len(config.Endpoints))
	for _, e := range config.Endpoints {
		e = strings.TrimRight(strings.TrimSpace(e), "/")
		if !strings.HasPrefix(e, "http://") && !strings.HasPrefix(e, "https://") {
			return nil, fmt.Errorf("tether: endpoint %q: expected http://HOST:PORT or https://HOST:PORT", e)
		}
		endpoints = append(endpoints, e)
	}
	c := &Client{
		endpoints: endpoints,
		token:     config.Token,
		retry:     config.RetryTimeout,
		attempt:   config.CallTimeout,
		clientID:  config.ClientID,
		nodeIDs:   map[uint64]int{},
		inFlight:  map[uint64]struct{}{},
	}
	if c.retry <= 0 {
		c.retry = 15 * time.Second
	}
	if c.attempt <= 0 {
		c.attempt = 5 * time.Second
	}
	if c.clientID == "" {
		var random [8]byte
		if _, err := rand.Read(random[:]); err != nil {
			return nil, fmt.Errorf("tether: drawing a client id: %w", err)
		}
		c.clientID = "go-" + hex.EncodeToString(random[:])
	}
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.TLSClientConfig = config.TLS
	c.http = &http.Client{Transport: transport}
	return c, nil
}

// ClientID is the id this client's request ids carry.
func (c *Client) ClientID() string { return c.clientID }

// nextRequestID numbers a write; done must be called once it is answered
// (or given up), so the server may forget the answers below the oldest
// one still outstanding.
func (c *Client) nextRequestID() (*requestID, func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sequence++
	sequence := c.sequence
	c.inFlight[sequence] = struct{}{}
	first := sequence
	for s := range c.inFlight {
		if s < first {
			first = s
		}
	}
	done := func() {
		c.mu.Lock()
		delete(c.inFlight, sequence)
		c.mu.Unlock()
	}
	return &requestID{ClientID: c.clientID, Sequence: sequence, FirstIncomplete: first}, done
}

// pick is the endpoint to try next.
func (c *Client) pick() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.current
}

// learned records which node answered at endpoint i.
func (c *Client) learned(i int, header http.Header) {
	id, err := strconv.ParseUint(header.Get("x-tether-node-id"), 10, 64)
	if err != nil || id == 0 {
		return
	}
	c.mu.Lock()
	c.nodeIDs[id] = i
	c.mu.Unlock()
}

// moveOn chooses the endpoint after a refusal at endpoint i: the leader
// it named, when known, else the next one.
func (c *Client) moveOn(i int, leader uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.current != i {
		return // another call moved already
	}
	if next, ok := c.nodeIDs[leader]; ok && leader != 0 && next != i {
		c.current = next
		return
	}
	c.current = (i + 1) % len(c.endpoints)
}

// errBadAnswer marks an answer this client cannot read (not the JSON it
// expects): asking again would get the same, so it is not retried.
var errBadAnswer = errors.New("an answer this client cannot read")

// badAnswer is an error wrapping errBadAnswer.
func badAnswer(format string, args ...any) error {
	return fmt.Errorf("tether: %w: %s", errBadAnswer, fmt.Sprintf(format, args...))
}

// retryable says whether err may go away by asking again (elsewhere).
func retryable(err error) (bool, uint64) {
	var api *Error
	if errors.As(err, &api) {
		return api.Code == CodeUnavailable, api.LeaderID
	}
	if errors.Is(err, errBadAnswer) {
		return false, 0
	}
	// Connection refused or reset, an answer cut off: the replica is down
	// or restarting. Every write carries a request id, so asking again
	// cannot apply it twice.
	return true, 0
}

// post sends one request to endpoint i and returns the answer when it is
// 200; other answers become *Error.
func (c *Client) post(ctx context.Context, i int, path string, body []byte) (*http.Response, error) {
	request, err := http.NewRequestWithContext(ctx, http.MethodPost, c.endpoints[i]+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	request.Header.Set("content-type", "application/json")
	if c.token != "" {
		request.Header.Set("authorization", "Bearer "+c.token)
	}
	response, err := c.http.Do(request)
	if err != nil {
		return nil, err
	}
	c.learned(i, response.Header)
	if response.StatusCode == http.StatusOK {
		return response, nil
	}
	defer response.Body.Close()
	return nil, errorOf(response)
}

// retrying runs attempt until it succeeds, fails for good, or the retry
// budget or the context ends. attempt gets the endpoint to use, and a
// function to call whenever a stream makes progress: the budget counts
// from the last progress, so a wait or watch that ran for an hour still
// gets its whole budget when its replica goes away.
func (c *Client) retrying(ctx context.Context, attempt func(i int, alive func()) error) error {
	deadline := time.Now().Add(c.retry)
	pause := 20 * time.Millisecond
	alive := func() {
		deadline = time.Now().Add(c.retry)
		pause = 20 * time.Millisecond
	}
	for {
		i := c.pick()
		err := attempt(i, alive)
		if err == nil {
			return nil
		}
		again, leader := retryable(err)
		if !again || ctx.Err() != nil {
			return err
		}
		c.moveOn(i, leader)
		if time.Now().After(deadline) {
			return fmt.Errorf("tether: gave up after %v: %w", c.retry, err)
		}
		timer := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			timer.Stop()
			return err
		case <-timer.C:
		}
		if pause < 500*time.Millisecond {
			pause *= 2
		}
	}
}

// call is one unary method: request in, response decoded into out.
func (c *Client) call(ctx context.Context, path string, in, out any) error {
	body, err := json.Marshal(in)
	if err != nil {
		return fmt.Errorf("tether: encoding the request: %w", err)
	}
	return c.retrying(ctx, func(i int, _ func()) error {
		attemptCtx, cancel := context.WithTimeout(ctx, c.attempt)
		defer cancel()
		response, err := c.post(attemptCtx, i, path, body)
		if err != nil {
			return err
		}
		defer response.Body.Close()
		if err := json.NewDecoder(response.Body).Decode(out); err != nil {
			var syntax *json.SyntaxError
			var shape *json.UnmarshalTypeError
			if errors.As(err, &syntax) || errors.As(err, &shape) {
				return badAnswer("the answer of %s: %v", path, err)
			}
			// Cut off mid-answer: the replica went away.
			return fmt.Errorf("tether: reading the answer of %s: %w", path, err)
		}
		return nil
	})
}

// streamLine is one line of a streamed answer.
type streamLine struct {
	Result json.RawMessage `json:"result"`
	Error  *struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// lines reads a newline-delimited JSON answer, calling each for every
// result until it returns done or an error, the stream fails (an *Error)
// or ends (io.ErrUnexpectedEOF).
func lines(response *http.Response, each func(json.RawMessage) (bool, error)) error {
	defer response.Body.Close()
	reader := bufio.NewReaderSize(response.Body, 64*1024)
	for {
		line, err := reader.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			var parsed streamLine
			if jsonErr := json.Unmarshal(line, &parsed); jsonErr != nil {
				return badAnswer("a line of the answer is not JSON: %v", jsonErr)
			}
			if parsed.Error != nil {
				return &Error{Status: http.StatusOK, Code: parsed.Error.Code, Message: parsed.Error.Message}
			}
			done, eachErr := each(parsed.Result)
			if eachErr != nil || done {
				return eachErr
			}
		}
		if err == io.EOF {
			return io.ErrUnexpectedEOF
		}
		if err != nil {
			return err
		}
	}
}
