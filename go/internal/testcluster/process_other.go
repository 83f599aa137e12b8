//go:build !linux

package testcluster

import "syscall"

// dieWithParent has no portable form off Linux; the test's cleanups kill
// the replicas.
func dieWithParent() *syscall.SysProcAttr { return nil }
