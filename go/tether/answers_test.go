package tether

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// An answer that is not the JSON expected fails at once, asked once: asking
// again would get the same. A replica that is unavailable is asked again.
func TestUnreadableAnswersAreNotRetriedAndUnavailableOnesAre(t *testing.T) {
	var asked atomic.Int32
	unreadable := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		asked.Add(1)
		_, _ = w.Write([]byte(`{"hold": "not an object"}`))
	}))
	defer unreadable.Close()
	client, err := New(Config{Endpoints: []string{unreadable.URL}, RetryTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	_, err = client.Holder(context.Background(), LockKey{Scope: "gpu-bind", Name: "n"})
	if !errors.Is(err, errBadAnswer) || asked.Load() != 1 || time.Since(started) > 5*time.Second {
		t.Fatalf("after %v and %d asks: %v", time.Since(started), asked.Load(), err)
	}

	asked.Store(0)
	busy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if asked.Add(1) < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"code": "UNAVAILABLE", "message": "no leader yet"}`))
			return
		}
		_, _ = w.Write([]byte(`{}`))
	}))
	defer busy.Close()
	client, err = New(Config{Endpoints: []string{busy.URL}, RetryTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	hold, err := client.Holder(context.Background(), LockKey{Scope: "gpu-bind", Name: "n"})
	if err != nil || hold != nil || asked.Load() != 3 {
		t.Fatalf("after %d asks: %+v, %v", asked.Load(), hold, err)
	}
}
